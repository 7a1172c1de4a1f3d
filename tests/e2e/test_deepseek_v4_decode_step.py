"""The batched DeepSeek-V4 decode step is what a CUDA graph can capture, checked on CPU
(float32, a tiny V4 at seeded random weights; the graph itself: tests/gpu).

- the step in bfloat16 (every layer's attention, hyper-connections, routers, head; not the
  CPU reference experts, whose per-expert loop reads counts: CUDA's grouped path does not)
  makes no host sync and no data-dependent Python branch: Tensor.item / tolist / __int__ /
  __bool__ / __float__ / __index__ and torch.tensor / as_tensor raise while it runs;
- `V4DecodeGraphs`' static buffers with padded rows (3 rows in bucket 4) and context-bucket
  page columns, each step run twice (the warm-up before a capture, then the replay), give
  the eager step's greedy tokens and logits within 1e-5 while contexts cross HCA and CSA
  windows, and after a sequence leaves mid-decode and a new one takes its slot;
- a sequence's slots and pages go back to the cache when it is freed;
- `bench-one-batch`'s roofline bytes for V4 count V4's own cache reads (a hand count for
  one row: window rows, HCA entries, CSA indexer keys and top-k entries).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4.graph import V4DecodeGraphs
from cpmoe.moe.experts import LocalExperts
from cpmoe.parallel.groups import ProcessGroups

TINY_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
    "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "sliding_window": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "hc_mult": 4,
    "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention",
                    "sliding_attention", "compressed_sparse_attention"],
    "compress_rate_hca": 16, "num_hash_layers": 2, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 4096,
}
LENGTHS, STEPS, TOL = (61, 5, 30), 12, 1e-5  # 61 + 12 crosses the rate-16 window at 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread


def _runner(dtype: torch.dtype = torch.float32) -> ModelRunner:
    runner = ModelRunner.from_config(TINY_V4, ProcessGroups.single(), dtype, seed=0)
    runner.allocate_kv(256)
    return runner


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


_SYNCS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__", "numpy")


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Every host read of a tensor and every tensor made from host data raises, except
    inside the CPU reference experts."""
    state = {"on": True}

    def guard(name, original):
        def wrapped(*args, **kwargs):
            if state["on"]:
                raise AssertionError(f"host sync in the V4 decode step: {name}")
            return original(*args, **kwargs)
        return wrapped

    for name in _SYNCS:
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, guard(f"torch.{name}", getattr(torch, name)))
    loop = LocalExperts._forward_loop

    def experts_unguarded(self, *args):
        state["on"] = False
        try:
            return loop(self, *args)
        finally:
            state["on"] = True

    monkeypatch.setattr(LocalExperts, "_forward_loop", experts_unguarded)
    try:
        yield
    finally:
        state["on"] = False
        monkeypatch.undo()


def test_v4_decode_step_makes_no_host_sync(monkeypatch):
    """In bfloat16, a dtype decode graphs capture (float32 runs eagerly and takes the
    reference's indexer top-k, which groups rows by length on the host)."""
    runner = _runner(torch.bfloat16)
    keys = list(range(len(LENGTHS)))
    tokens = runner.prefill(_prompts(), keys, last_only=True).argmax(-1)
    kv = runner.kv
    positions = torch.tensor([kv.seqs[k].length for k in keys])
    kv.append_decode(keys)
    step = kv.decode_step(keys)  # the host's part: books -> indices
    batch = ForwardBatch(is_decode=True, input_ids=tokens, positions=positions,
                         token_to_seq=torch.arange(len(keys)), kv=kv)
    with torch.no_grad(), no_host_sync(monkeypatch):
        logits = runner.model.logits(runner.model.model(batch, step))
    assert torch.isfinite(logits).all()


class _ReplayOnCPU:
    """Stands in for a captured graph: replay runs the step again into the same output."""

    def __init__(self, graphs: V4DecodeGraphs, bs: int, step) -> None:
        self.graphs, self.batch, self.step = graphs, graphs._batch(bs), step
        self.out = graphs._forward(self.batch, step)  # the warm-up before a capture

    def replay(self) -> None:
        self.out.copy_(self.graphs._forward(self.batch, self.step))


def test_v4_static_padded_step_matches_eager(monkeypatch):
    monkeypatch.setattr(V4DecodeGraphs, "_capture",
                        lambda self, bs, step: ((g := _ReplayOnCPU(self, bs, step)), g.out))
    eager, static = _runner(), _runner()
    static.graphs = V4DecodeGraphs(static, max_bs=8, max_context=static.kv.capacity)
    keys = list(range(len(LENGTHS)))
    want = eager.prefill(_prompts(), keys, last_only=True)
    got = static.prefill(_prompts(), keys, last_only=True)
    for s in range(STEPS):
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {s}: tokens differ"
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"step {s}: logits differ by {diff:.3e}"
        tokens = want.argmax(-1).tolist()
        if s == STEPS // 2:  # a sequence leaves; a new one takes its slot and pages
            for r in (eager, static):
                r.kv.free(keys[1])
            keys, tokens = [keys[0], keys[2], 7], [tokens[0], tokens[2]]
            new = [r.prefill([_prompts()[0][:60]], [7], last_only=True)
                   for r in (eager, static)]
            assert (new[0] - new[1]).abs().max().item() <= TOL
            tokens.append(int(new[0].argmax()))
        want, got = eager.decode(keys, tokens), static.decode(keys, tokens)
    assert set(static.graphs.graphs) == {(4, 512)}, "3 rows: bucket 4, one context bucket"


def test_v4_freed_sequence_returns_its_slot_and_pages():
    runner = _runner()
    kv = runner.kv
    free_slots = len(kv._free_slots)
    free_pages = {m: len(p) for m, p in kv._free_entry_pages.items()}
    runner.prefill(_prompts(), [0, 1, 2], last_only=True)
    assert len(kv._free_slots) == free_slots - 3
    assert kv.nbytes_used() > 0
    for k in (0, 1, 2):
        kv.free(k)
    assert len(kv._free_slots) == free_slots and kv.nbytes_used() == 0
    assert {m: len(p) for m, p in kv._free_entry_pages.items()} == free_pages


def test_v4_roofline_counts_its_own_cache_reads(monkeypatch):
    from cpmoe.bench.one_batch import _step_bytes
    runner = _runner()
    kv = runner.kv
    # Row of 61 tokens, step 62: per layer 16 window rows of 32; HCA (m 16) 3 entries of
    # 32; each CSA (m 4) 15 indexer keys of 16 and its top 8 entries of 32; float32.
    assert kv.step_read_bytes([61]) == 4 * (4 * 16 * 32 + 3 * 32 + 2 * (15 * 16 + 8 * 32))
    base = _step_bytes(runner, [1] * 4, [61])
    monkeypatch.setattr(type(kv), "step_read_bytes", lambda self, lengths: 10**9)
    assert _step_bytes(runner, [1] * 4, [61]) - base == 10**9 - 4 * 3136
