"""DeepSeek-V4 in bf16 on CUDA against the float32 path (skipped without a GPU; on the GPU
machine: `python3 -m pytest tests/gpu/test_deepseek_v4_cuda.py -q`).

A small V4 (hidden 256, 8 heads of 128 with 64 rotated channels, layers HCA / CSA /
sliding / CSA, 16 experts top-4 with the first two layers hash-routed, hc 4, window 64,
indexer 8 heads of 64 with top-64) at seeded random weights, the same values in both dtypes
(drawn in float32, rounded to bf16). Prompts of 700, 33 and 1 tokens (700 passes the HCA
rate 128 five times and gives 175 CSA entries against top-64).

- prefill: the logits of every position, bf16 vs float32, relative Frobenius error <= 5e-2
  per sequence;
- decode: 8 teacher-forced steps (both dtypes fed the float32 greedy tokens), each step's
  logits within a relative Frobenius error of 5e-2 of float32.
The tolerance is bf16's ~3 significant digits through 4 layers of low-rank projections,
hyper-connections and MoE (measured errors sit near 1e-2); indexer picks may differ where
scores nearly tie, which the whole-matrix norm absorbs.

- prefill attention's two branches: every layer's `prefill_attention` of the bf16 prefill is
  run both with the sparse Triton kernel (the CUDA default, `deepseek_v4/sparse.py`) and
  with the gather + fp32 `sink_attention` reference branch (forced), on the same inputs;
  the kernel's result goes on. Elementwise, with u = 2^-8, delta the fp32 error bound of a
  score and attn(|k|) = sum_n p_n |k_n| from the kernel's own inputs:
  |kernel - reference| <= u * (attn(|k|) + 2 |reference|) + (2 delta + 1e-5) * attn(|k|)
  + 1e-6 (the kernel's bound against fp32, tests/gpu/test_v4_sparse_attention_cuda.py, plus
  the reference branch's own rounding of its output to bf16). Comparing logits instead would
  blur a wrong index or mask into the model's bf16 noise (a dropped window key moved the
  700-token logits by 9e-2, the 33-token ones not at all).

- the indexer's two branches: every call of the indexer's top-k in the bf16 prefill
  (`deepseek_v4/indexer.py`, the CUDA default; once per CSA layer and row block) has its
  kernel's scores checked against the scorer's fp32 torch branch on the same inputs,
  elementwise within (3 dI + 2 h + 4) 2^-24 scale sum_h |w| (|q| . |k|) (derived in
  tests/gpu/test_v4_indexer_cuda.py), -inf exactly where not visible, and its picks against
  a stable sort of those scores (exactly). Scores, not the torch branch's picks: those may
  legitimately differ where scores nearly tie.

- CUDA graphs (`V4DecodeGraphs`): greedy decode of the same prompts with the decode step
  replayed from graphs (bf16; 3 rows in batch bucket 4, one context bucket) gives the
  eager step's tokens, token for token, and every step's logits within a relative
  Frobenius error of GRAPH_TOL = 1e-2 (the same math: only the padded row count and page
  columns change the kernels' shapes and so their rounding; measured errors should sit far
  below it). float32 is not captured (its experts run the reference loop, which reads
  counts to the host).
"""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 128,
    "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64,
    "sliding_window": 64, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 64,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "hc_mult": 4,
    "compress_ratios": [128, 4, 0, 4], "num_hash_layers": 2, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}
LENGTHS, STEPS, TOL = (700, 33, 1), 8, 5e-2
GRAPH_TOL = 1e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def run_both(device: str, config: dict = SMALL_V4, lengths=LENGTHS, steps: int = STEPS):
    """(float32 results, bf16 results): per-sequence prefill logits and per-step decode
    logits, both fed the float32 greedy tokens."""
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, config["vocab_size"], (n,), generator=gen).tolist()
            for n in lengths]
    keys = list(range(len(seqs)))
    out, tokens = {}, None
    for dtype in (torch.float32, torch.bfloat16):
        runner = ModelRunner.from_config(config, ProcessGroups.single(device), dtype, seed=0)
        runner.allocate_kv(sum(lengths) + len(lengths) * (steps + 1))
        prefill = runner.prefill(seqs, keys).float().cpu()
        last = prefill[torch.tensor(lengths).cumsum(0) - 1]
        if tokens is None:
            tokens = [last.argmax(-1).tolist()]
        logits = []
        for s in range(steps):
            logits.append(runner.decode(keys, tokens[s]).float().cpu())
            if dtype == torch.float32:
                tokens.append(logits[-1].argmax(-1).tolist())
        out[dtype] = (prefill.split(list(lengths)), logits)
    return out[torch.float32], out[torch.bfloat16]


@cuda
def test_v4_bf16_prefill_and_decode_match_float32():
    (pre32, dec32), (pre16, dec16) = run_both("cuda")
    for n, a, b in zip(LENGTHS, pre16, pre32):
        assert _rel(a, b) <= TOL, f"prefill of {n} tokens: bf16 vs float32 {_rel(a, b):.3e}"
    for s, (a, b) in enumerate(zip(dec16, dec32)):
        assert _rel(a, b) <= TOL, f"decode step {s}: bf16 vs float32 {_rel(a, b):.3e}"


U_BF16 = 2.0 ** -8


def prefill_small_v4_bf16() -> None:
    """SMALL_V4's bf16 prefill of prompts of LENGTHS (the layers' calls are what the
    kernel-branch tests check)."""
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, SMALL_V4["vocab_size"], (n,), generator=gen).tolist()
            for n in LENGTHS]
    runner = ModelRunner.from_config(SMALL_V4, ProcessGroups.single("cuda"), torch.bfloat16,
                                     seed=0)
    runner.prefill(seqs)


@cuda
def test_v4_prefill_sparse_kernel_branch_matches_reference_branch(monkeypatch):
    from cpmoe.models.deepseek_v4 import model, prefill
    from tests.gpu.test_v4_sparse_attention_cuda import abs_attention

    kernel, applies, attention = (prefill.sparse_sink_attention, prefill.kernel_applies,
                                  prefill.prefill_attention)
    use_kernel, slack, worst = [True], [], []

    def kernel_with_bounds(q, pool, idx, valid, sinks, scale, out, lens=None):
        """The kernel, noting each block's attn(|k|) and fp32 score error bound delta."""
        kv = pool.float()[idx]
        delta = q.shape[-1] * 2.0 ** -24 * scale * (q.float().norm(dim=-1).max()
                                                    * kv.norm(dim=-1).max()).item()
        slack.append((abs_attention(q, kv, valid, sinks, scale), delta))
        return kernel(q, pool, idx, valid, sinks, scale, out, lens=lens)

    def both_branches(*args):
        slack.clear()
        got = attention(*args)
        use_kernel[0] = False
        want = attention(*args)
        use_kernel[0] = True
        assert slack, "the kernel branch did not run"
        abs_k = torch.cat([a for a, _ in slack])  # blocks run in row order
        delta = max(d for _, d in slack)
        bound = (U_BF16 * (abs_k + 2 * want.float().abs()) + (2 * delta + 1e-5) * abs_k
                 + 1e-6)
        worst.append(((got.float() - want.float()).abs() / bound).max().item())
        return got

    monkeypatch.setattr(prefill, "sparse_sink_attention", kernel_with_bounds)
    monkeypatch.setattr(prefill, "kernel_applies",
                        lambda device, dtype: use_kernel[0] and applies(device, dtype))
    monkeypatch.setattr(model, "prefill_attention", both_branches)
    prefill_small_v4_bf16()
    print(f"V4 prefill attention, kernel vs reference branch, error / bound per layer: {worst}")
    assert len(worst) == SMALL_V4["num_hidden_layers"], worst
    assert max(worst) <= 1.0, worst


@cuda
def test_v4_prefill_indexer_kernel_matches_torch_scores(monkeypatch):
    from bench.v4_indexer import torch_scores
    from cpmoe.models.deepseek_v4 import attention
    from tests.gpu.test_v4_indexer_cuda import score_bound

    from cpmoe.models.deepseek_v4.indexer import indexer_scores

    kernel, worst = attention.indexer_topk, []

    def checked(q, keys, w, scale, bounds, k):
        """The kernel's scores, checked against the torch branch's scores of the same
        inputs; its picks, against a stable sort of its scores."""
        got = indexer_scores(q, keys, w, scale, bounds)
        c = torch.arange(keys.shape[0], device=q.device)
        visible = (c[None, :] >= bounds[0][:, None]) & (c[None, :] < bounds[1][:, None])
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        want = torch_scores(q, keys, w, scale, visible)
        bound = score_bound(q, keys, w, scale)
        torch.backends.cuda.matmul.allow_tf32 = saved
        assert torch.equal(got == float("-inf"), ~visible)
        err = torch.where(visible, got - want, 0).abs()
        worst.append((err / bound.clamp(min=1e-30)).max().item())
        picks = kernel(q, keys, w, scale, bounds, k)
        order = got.sort(dim=-1, descending=True, stable=True).indices[:, :picks.shape[1]]
        assert torch.equal(picks, torch.where(visible.gather(1, order), order, -1))
        return picks

    monkeypatch.setattr(attention, "indexer_topk", checked)
    prefill_small_v4_bf16()
    print(f"V4 prefill indexer, kernel vs torch scores, error / bound per call: {worst}")
    assert len(worst) == 2, worst  # CSA layers 1 and 3, one row block each
    assert max(worst) <= 1.0, worst


def greedy_decode(dtype: torch.dtype, graphs: bool, device: str = "cuda",
                  config: dict = SMALL_V4, lengths=LENGTHS, steps: int = STEPS):
    """(greedy tokens per step, logits per step) of the prompts' decode, the step replayed
    from CUDA graphs or run eagerly."""
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, config["vocab_size"], (n,), generator=gen).tolist()
            for n in lengths]
    keys = list(range(len(seqs)))
    runner = ModelRunner.from_config(config, ProcessGroups.single(device), dtype, seed=0)
    runner.allocate_kv(sum(lengths) + len(lengths) * (steps + 1))
    if graphs:
        assert runner.can_capture_graphs()
        runner.capture_decode_graphs(8)
    tokens = [runner.prefill(seqs, keys, last_only=True).argmax(-1).tolist()]
    logits = []
    for _ in range(steps):
        logits.append(runner.decode(keys, tokens[-1]).float().cpu())
        tokens.append(logits[-1].argmax(-1).tolist())
    if graphs:  # 3 rows: batch bucket 4; one context bucket (the cache's 761 tokens)
        assert [bs for bs, _ in runner.graphs.graphs] == [4], sorted(runner.graphs.graphs)
    return tokens, logits


@cuda
def test_v4_cuda_graph_decode_matches_eager():
    want_tokens, want = greedy_decode(torch.bfloat16, graphs=False)
    got_tokens, got = greedy_decode(torch.bfloat16, graphs=True)
    errors = [_rel(a, b) for a, b in zip(got, want)]
    print(f"V4 graph vs eager, bf16, relative errors per step: {errors}")
    assert max(errors) <= GRAPH_TOL, f"graph vs eager: {errors}"
    assert got_tokens == want_tokens
