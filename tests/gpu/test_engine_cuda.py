"""The decode engine on CUDA (skipped without a GPU): CUDA-graph replay equals eager decode
token for token wherever rounding cannot flip a token, on a full and on a padded bucket;
bf16 greedy decode follows the float32 run wherever the float32 top-2 gap exceeds the bf16
logit error; the overlap schedule (tokens fed on the device, landed a step late) gives the
tokens of steps run one after another, through the graphs; experts on few rows never read a
count to the host."""

from __future__ import annotations

import pytest
import torch

from cpmoe.engine.options import EngineOptions, prepare_runner
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.parallel.groups import ProcessGroups

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# small, but at the real head shape (32/4 heads of 128) so the decode kernel runs as in use
CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=4096,
              hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
              num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
              num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
              max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False)


def runner(dtype: torch.dtype, quantization: str | None = None) -> ModelRunner:
    return ModelRunner.from_config(CONFIG, ProcessGroups.single("cuda"), dtype, seed=3,
                                   quantization=quantization)


def prompts(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 4096, (length + 7 * i,), generator=gen).tolist() for i in range(n)]


def _graph_runner(graphs: bool, quantization: str | None = None,
                  kv_cache_dtype: str = "auto") -> ModelRunner:
    r = runner(torch.bfloat16, quantization)
    fp8 = any(p.dtype == torch.float8_e4m3fn for p in r.model.parameters())
    assert fp8 == (quantization == "fp8")
    opts = EngineOptions(page_size=16, disable_cuda_graph=not graphs, cuda_graph_max_bs=32,
                         max_total_tokens=8192, kv_cache_dtype=kv_cache_dtype)
    prepare_runner(r, opts, None)
    assert (r.graphs is not None) == graphs
    assert not r.kv.seqs and r.kv.used == 0  # the prefill warm-up's sequence is freed
    return r


def _forced_decode(r: ModelRunner, seqs: list[list[int]], tokens: list[list[int]]) -> list:
    """Prefill, then decode feeding `tokens` (teacher forcing): the logits of every step."""
    keys = list(range(len(seqs)))
    logits = [r.extend([Segment(k, s) for k, s in zip(keys, seqs)])]
    for step in range(len(tokens[0]) - 1):
        # a replay's logits live in the graph's output buffer until the next replay
        logits.append(r.decode(keys, [t[step] for t in tokens]).clone())
    return logits


@cuda
@pytest.mark.parametrize("rows, quantization, kv_cache_dtype", [
    (16, None, "auto"), (13, None, "auto"), (16, "fp8", "auto"), (13, "fp8", "auto"),
    (13, None, "fp8_e4m3"), (13, "fp8", "fp8_e4m3")])
def test_graph_replay_follows_eager_decode(rows, quantization, kv_cache_dtype):
    """16 rows fill a graph bucket, 13 are padded to it; bf16, and `--quantization fp8`
    (FP8 GEMMs, FP8 decode experts), and either over FP8 K/V pools (--kv-cache-dtype
    fp8_e4m3). cuBLAS may pick other kernels under stream capture and for the padded
    shape, so the logits may differ by rounding (|d| measured per step; FP8
    activations can turn such a difference into one quantization step): with the eager
    run's tokens fed to both, every step whose eager top-2 gap exceeds 2|d| must pick the
    same token, and the logits stay within bf16's 2^-8 relative error per layer (a wrong
    page, slot, scale or stale buffer moves them by far more)."""
    seqs = prompts(rows, 100)
    tokens = generate(_graph_runner(False, quantization, kv_cache_dtype), seqs, 24,
                      options=EngineOptions(page_size=16, disable_cuda_graph=True,
                                            max_total_tokens=8192,
                                            kv_cache_dtype=kv_cache_dtype))
    eager = _forced_decode(_graph_runner(False, quantization, kv_cache_dtype), seqs, tokens)
    graph_runner = _graph_runner(True, quantization, kv_cache_dtype)
    assert (graph_runner.kv.k[0].dtype == torch.float8_e4m3fn) == (kv_cache_dtype != "auto")
    graph = _forced_decode(graph_runner, seqs, tokens)
    checked = 0
    for step, (le, lg) in enumerate(zip(eager, graph)):
        le, lg = le.float(), lg.float()
        d = (lg - le).abs().max(dim=-1).values
        assert d.max() < 0.05 * le.abs().max(), f"step {step}: padded replay off by {d.max()}"
        top2 = le.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * d
        checked += int(decisive.sum())
        assert not (decisive & (lg.argmax(-1) != le.argmax(-1))).any(), f"step {step}"
    # FP8 activations turn a rounding difference into a quantization step, so fewer steps
    # are decisive (at 5800ba7 on the H200: 145 of 312 at 13 rows, 0.46)
    assert checked > (0.5 if quantization is None else 0.4) * 24 * len(seqs)


@cuda
def test_fp8_kv_pages_read_back_on_cuda_follow_one_piece_prefill():
    """--kv-cache-dtype fp8_e4m3 on the paths that read pages back, bf16 on CUDA: a prompt
    prefilled in chunks of 64 (each chunk attends its cached FP8 prefix) and a sequence
    forked from it at 150 tokens (a partly filled page copied, whole ones shared) give the
    one-piece prefill's logits within the attention splits' bf16 rounding (a wrong page or
    an unwidened FP8 value moves them by far more)."""
    r = _graph_runner(False, None, "fp8_e4m3")
    seq = prompts(1, 300)[0]
    whole = r.extend([Segment(0, seq)], last_only=False)
    chunks = [r.extend([Segment(1, seq[i:i + 64], i)], last_only=False)
              for i in range(0, len(seq), 64)]
    r.kv.fork(2, 1, 150)
    forked = r.extend([Segment(2, seq[150:], 150)], last_only=False)
    for got, want in ((torch.cat(chunks), whole), (forked, whole[150:])):
        err = (got - want).abs().max()
        assert err < 0.05 * want.abs().max(), f"off by {err.item():.3g}"
    assert r.kv.k[0].dtype == torch.float8_e4m3fn and r.kv.k[0].view(torch.uint8).any()


@cuda
def test_overlapped_graph_decode_equals_synced_decode():
    """The same graphs replayed with the same rows give bitwise the same logits, so feeding
    the device's argmax (placeholders resolved in the graph's input buffer) must give
    exactly the synced run's tokens, an EOS that lands one step late included."""
    r = _graph_runner(True)
    seqs = prompts(13, 100)
    opts = EngineOptions(page_size=16, max_total_tokens=8192)
    free_run = generate(r, seqs, 24, options=opts)
    eos = free_run[2][9]
    synced = generate(r, seqs, 24, (eos,), options=EngineOptions(
        page_size=16, max_total_tokens=8192, disable_overlap_schedule=True))
    assert any(len(t) < 24 for t in synced)
    assert generate(r, seqs, 24, (eos,), options=opts) == synced
    assert r.kv.used == 0


@cuda
def test_bf16_greedy_decode_follows_float32_where_the_gap_exceeds_bf16_error():
    """The float32 run's tokens are fed to the bf16 run (teacher forcing), so both see the
    same prefix at every step. bf16 keeps 8 significant bits: each layer's output carries a
    relative error of about 2^-8, so the logits of the two runs differ by some |d| measured
    at each step. A bf16 argmax that differs from float32's is a failure only where float32's
    top-1 / top-2 gap is larger than 2|d| (then no rounding of that size could flip it)."""
    seqs = prompts(8, 200)
    ref = runner(torch.float32)
    ref.allocate_kv(8192)
    steps32: list[torch.Tensor] = []
    tokens = generate(ref, seqs, 64, observe=steps32.append)
    bf = runner(torch.bfloat16)
    bf.allocate_kv(8192)
    keys = list(range(len(seqs)))
    logits = [bf.extend([Segment(k, s) for k, s in zip(keys, seqs)])]
    for step in range(63):
        logits.append(bf.decode(keys, [t[step] for t in tokens]))
    checked = flips = 0
    for step, (l32, l16) in enumerate(zip(steps32, logits)):
        d = (l16 - l32).abs().max(dim=-1).values
        top2 = l32.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        decisive = gap > 2 * d
        checked += int(decisive.sum())
        wrong = decisive & (l16.argmax(-1) != l32.argmax(-1))
        flips += int(wrong.sum())
        assert d.max() < 0.05 * l32.abs().max(), f"step {step}: bf16 logits off by {d.max()}"
    assert flips == 0
    assert checked > 0.5 * 64 * len(seqs)  # most steps are decisive: the test has teeth


@cuda
@pytest.mark.parametrize("path", ["grouped", "fused"])
def test_experts_on_few_rows_never_sync_with_the_host(path):
    """Both GPU expert paths (the grouped GEMM of prefill, the fused decode kernels that
    `forward` picks for few rows) in bf16 against the float32 loop: bf16 keeps 8 significant
    bits, and two GEMMs with bf16 inputs and outputs leave a relative error of a few 2^-8."""
    from cpmoe.moe.experts import LocalExperts
    m = LocalExperts(8, 256, 64, torch.bfloat16, shard=(1, 2, 0, 1)).cuda()
    torch.nn.init.normal_(m.gate_up_proj, std=0.05)
    torch.nn.init.normal_(m.down_proj, std=0.05)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(-1, 8, (64, 8), device="cuda")
    w = torch.rand(64, 8, device="cuda", dtype=torch.bfloat16)
    want = m.float()._forward_loop(x.float(), ids, w.float())
    m = m.to(torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync raises
    try:
        got = (m._forward_grouped(x, ids, w) if path == "grouped" else m(x, ids, w)).float()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ((got - want).norm() / want.norm()).item() < 3e-2


@cuda
def test_kv_pools_sized_by_mem_fraction_fit_beside_fragmented_memory():
    """--mem-fraction-static sizes the pools from what the driver has free, so memory the
    caching allocator holds in segments it cannot give back (freed blocks between live ones,
    as an FP8 load's 16-bit weights between the FP8 ones it keeps) counts as used: here 30% of
    the card is such pieces, twice the 15% kept back, and the pools must still allocate
    (sized from the allocated bytes, an FP8 server on an H100 failed at its pools at
    284afcb). The pools then take what the fraction leaves: within a page per layer of it."""
    run = runner(torch.bfloat16)
    dev = run.device
    free, total = torch.cuda.mem_get_info(dev)
    block = 2 << 20  # 2 MiB tensors: the allocator packs ten into each 20 MiB segment
    pieces = [torch.empty(block, dtype=torch.uint8, device=dev)
              for _ in range(int(free * 0.6) // block)]
    kept = pieces[::2]  # every segment keeps live blocks, so none can be released
    del pieces
    tokens = run.kv_tokens_for_memory(0.85)
    kv = run.allocate_kv(tokens)
    left, _ = torch.cuda.mem_get_info(dev)
    want = total * 0.15
    slack = 2 * len(kv.k) * kv.k[0][0].numel() * kv.k[0].element_size()  # a page per pool
    assert kv.capacity >= tokens > 0
    assert want - slack - (64 << 20) <= left <= want + slack + (64 << 20), (left, want)
    del kept
