"""FP8 compute on CUDA against dequantized references (skipped without a GPU; on the GPU
machine: `python3 -m pytest tests/gpu/test_fp8_cuda.py -q -s`).

Tolerances. Each GEMM is checked twice:
- against its own float32 reference with the same quantized operands (`*_ref`): only
  accumulation order and the bf16 output differ, relative Frobenius error < 1e-2;
- against bf16 with dequantized weights and unquantized activations (what an FP8 engine
  replaces): the stated FP8 tolerance, relative Frobenius error < 5e-2 (e4m3 keeps 3
  mantissa bits: each activation is rounded by up to 2^-4 of its value, ~3% rms over
  random data).
The engine comparison (an FP8 checkpoint with FP8 GEMMs vs the same checkpoint dequantized
to bf16 at load, `cpmoe check`-style) prints first-token matches and logit differences.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpmoe.ops import fp8, fp8_gemm
from cpmoe.ops.fp8 import dequantize, quantize_block_fp8

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REF_TOL, FP8_TOL = 1e-2, 5e-2
BLOCK = (128, 128)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fp8_weight(n: int, k: int, experts: int | None = None):
    w = torch.randn(experts or 1, n, k, device="cuda") * 0.05
    pairs = [quantize_block_fp8(w[e], BLOCK) for e in range(w.shape[0])]
    q = torch.stack([p[0] for p in pairs])
    s = torch.stack([p[1] for p in pairs])
    deq = torch.stack([dequantize(q[e], s[e], BLOCK) for e in range(w.shape[0])])
    return (q, s, deq) if experts else (q[0], s[0], deq[0])


@cuda
@pytest.mark.parametrize("m", [1, 13, 37, 64, 4096])
@pytest.mark.parametrize("n,k", [(2048, 768), (4096, 2048)])
def test_fp8_linear_matches_dequantized_bf16(m, n, k):
    torch.manual_seed(0)
    q, s, deq = fp8_weight(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = fp8_gemm.fp8_linear(x, q, s, BLOCK)
    path = ("skinny" if fp8_gemm.skinny_fits(m, q, BLOCK)
            else fp8_gemm.scaled_mm_refusal(m, n, k) or "F.scaled_mm")
    print(f"\nFP8 linear {m}x{n}x{k}: {path}")
    assert got.dtype == torch.bfloat16
    assert rel(got, fp8_gemm.fp8_linear_ref(x.float(), q, s, BLOCK)) < REF_TOL
    assert rel(got, F.linear(x, deq.to(torch.bfloat16))) < FP8_TOL


@cuda
@pytest.mark.parametrize("block_m", [None, 1, 4, 32])
@pytest.mark.parametrize("m,rows", [(1, 16), (37, 48), (4099, 4099)])
def test_quantize_act_matches_quantize_act_ref_bit_for_bit(block_m, m, rows):
    """Every tile gives the reference's values and scales exactly (the GPU's cast rounds to
    nearest even, carries and subnormals included); padded rows are zero."""
    torch.manual_seed(0)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16) * torch.logspace(
        -4, 4, m, device="cuda")[:, None].to(torch.bfloat16)
    cfg = None if block_m is None else {"BLOCK_M": block_m, "num_warps": 4}
    q, s = fp8.quantize_act(x, 128, rows, config=cfg)
    qr, sr = fp8.quantize_act_ref(x, 128)
    assert torch.equal(q[:m].view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s[:m], sr) and s.stride() == (1, rows)
    assert not q[m:].view(torch.uint8).any() and not s[m:].any()


@cuda
@pytest.mark.parametrize("m", [1, 64, 4099])
@pytest.mark.parametrize("hidden", [2048, 3584])  # Qwen3-30B-A3B's; one not a power of two
def test_add_rms_norm_fp8_rows_match_quantize_act_ref_bit_for_bit(m, hidden):
    """The norm's own FP8 rows are `quantize_act_ref` of its bf16 output, exactly, and are
    what quantize_act of that output returns (no launch)."""
    from cpmoe import ops
    torch.manual_seed(0)
    x, r = (torch.randn(2, m, hidden, device="cuda", dtype=torch.bfloat16) * torch.logspace(
        -3, 3, m, device="cuda")[:, None].to(torch.bfloat16)).unbind(0)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    out, summed = ops.add_rms_norm(x, r, w, 1e-6, quant_group=128)
    out0, summed0 = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(out, out0) and torch.equal(summed, summed0)
    q, s = fp8.quantize_act(out, 128)
    qr, sr = fp8.quantize_act_ref(out, 128)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr) and s.stride() == (1, m)
    assert fp8.quantize_act(out, 128)[0] is q


@cuda
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_decode_attention_fp8_output_matches_quantize_act_ref_bit_for_bit(splits):
    """Decode attention's FP8 output (one group a head; written by stage 2, or by stage 1
    at one split) is `quantize_act_ref` of its bf16 output exactly, at Qwen3-30B-A3B's
    heads, and what quantize_act returns."""
    from cpmoe.cp.paged_attention import paged_decode_attention
    torch.manual_seed(0)
    B, H, Hkv, D, page, pages = 64, 32, 4, 128, 16, 64
    kc, vc = torch.randn(2, B * pages, page, Hkv, D, device="cuda",
                         dtype=torch.bfloat16).unbind(0)
    table = torch.randperm(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
    lens = torch.randint(1, pages * page, (B,), device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    o, _ = paged_decode_attention(q, kc, vc, table, lens, D ** -0.5, num_splits=splits,
                                  quant_group=128)
    offer = fp8.offered(o.view(B, H * D), 128)
    o0, _ = paged_decode_attention(q, kc, vc, table, lens, D ** -0.5, num_splits=splits)
    assert offer is not None and torch.equal(o, o0)
    q8, s8 = fp8.quantize_act(o.view(B, H * D), 128)
    assert q8 is offer[0]
    qr, sr = fp8.quantize_act_ref(o.view(B, H * D), 128)
    assert torch.equal(q8.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s8, sr) and s8.stride() == (1, B)


@cuda
@pytest.mark.parametrize("pool", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_attention_block_table_read_ahead_gives_the_same_bits(pool):
    """Stage 1 reading the block table PAGE_IDS entries at a time (each tile's pages
    gathered from registers, so Triton can copy the next tile while this one is used)
    against each tile reading its own entries: the same keys in the same order, the same
    bits; scattered pages, rows of every length up to 1,024 keys, 1 to 4 splits."""
    from cpmoe.cp.paged_attention import paged_decode_attention
    from cpmoe.ops import fill_kv_scale
    torch.manual_seed(2)
    B, H, Hkv, D, page, pages = 64, 32, 4, 128, 16, 64
    kc, vc = torch.randn(2, B * pages, page, Hkv, D, device="cuda").to(pool).unbind(0)
    table = torch.randperm(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
    lens = torch.randint(0, pages * page + 1, (B,), device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    kv_scale = torch.empty(4, device="cuda")
    fill_kv_scale(kv_scale, 0.5, 0.25)
    for splits in (1, 2, 4):
        got = [paged_decode_attention(q, kc, vc, table, lens, D ** -0.5, num_splits=splits,
                                      kv_scale=kv_scale, config=dict(
                                          BLOCK_N=64, num_warps=4, num_stages=3, PAGE_IDS=ids))
               for ids in (0, 64, 8)]
        for o, lse in got[1:]:
            assert torch.equal(o, got[0][0]) and torch.equal(lse, got[0][1]), splits


@cuda
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_attention_reads_fp8_pools_times_the_layer_scales(splits):
    """FP8 pools with a checkpoint's k_scale / v_scale at Qwen3-30B-A3B's heads: the kernel
    (scales read from the device, so a graph replay follows a changed scale) against the
    float32 reference over codes x scale, within 2^-5 of the attention of |v|, and again on
    a replay after the scales change. The bound: the codes are exact in float16 and q
    rounds to float16, moving each score by up to 2^-11 of sum |q_i k_i| x scale (about 1e-2
    here, so p by under 1%); p rounds to float16 and o to bf16 (2^-11, 2^-9), and a kernel
    that widened K and V to bf16 times the scales (the code before d2524f8) stayed within
    it too; a scale not applied is off by its factor."""
    from cpmoe.cp.paged_attention import paged_decode_attention, paged_decode_attention_ref
    from cpmoe.ops import fill_kv_scale
    torch.manual_seed(1)
    B, H, Hkv, D, page, pages = 16, 32, 4, 128, 16, 32
    kc, vc = (torch.randn(2, B * pages, page, Hkv, D, device="cuda") * 30
              ).to(torch.float8_e4m3fn).unbind(0)
    table = torch.randperm(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
    lens = torch.randint(1, pages * page, (B,), device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    kv_scale = torch.empty(4, device="cuda")

    def check(o):
        want, _ = paged_decode_attention_ref(q, kc, vc, table, lens, D ** -0.5, kv_scale)
        mag, _ = paged_decode_attention_ref(q, kc, vc.float().abs().to(vc.dtype), table, lens,
                                            D ** -0.5, kv_scale)
        assert ((o.float() - want).abs() <= 2.0 ** -5 * mag + 1e-3).all()

    fill_kv_scale(kv_scale, 0.01, 0.3)
    graph = torch.cuda.CUDAGraph()
    paged_decode_attention(q, kc, vc, table, lens, D ** -0.5, num_splits=splits,
                           kv_scale=kv_scale)  # compiled before the capture
    with torch.cuda.graph(graph):
        o, _ = paged_decode_attention(q, kc, vc, table, lens, D ** -0.5, num_splits=splits,
                                      kv_scale=kv_scale)
    graph.replay()
    check(o)
    fill_kv_scale(kv_scale, 0.02, 1.7)
    graph.replay()
    check(o)


@cuda
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("rows", [1, 37, 5000])
def test_swiglu_quantize_matches_swiglu_kernel_then_quantize_act_ref(limit, rows):
    """The fused SwiGLU + quantization is the unfused path bit for bit: the same SwiGLU
    expression rounded to bf16 (ops' kernel), then quantize_act_ref's values and scales."""
    from cpmoe import ops
    torch.manual_seed(3)
    h = torch.randn(rows, 2 * 768, device="cuda", dtype=torch.bfloat16) * 4
    q, s = fp8.swiglu_quantize(h, 128, limit)
    gate, up = h.chunk(2, dim=-1)
    act = ops.silu_and_mul(h) if limit is None else ops.clamped_swiglu(gate, up, limit)
    qr, sr = fp8.quantize_act_ref(act, 128)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr) and s.stride() == (1, rows)


# The skinny decode GEMM quantizes its rows with quantize_act's arithmetic and multiplies the
# same FP8 operands as quantize_act + F.scaled_mm: only the summation order (and the FP8
# MMA's accumulation within each 128-input dot) differs, and then each side rounds to bf16
# once, so an element may land one bf16 step (at most 2^-7 of its value) away: relative
# Frobenius error < 4e-3, half of what a step on every element would give. A wrong scale,
# group or split scrambles the output (error of order 1).
SKINNY_TOL = 4e-3


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp8_linear's path for many rows, written out: quantize_act + F.scaled_mm."""
    m = x.shape[0]
    rows = -(-m // fp8_gemm.SCALED_MM_ROWS) * fp8_gemm.SCALED_MM_ROWS
    xq, xs = fp8.quantize_act(x, 128, rows)
    return F.scaled_mm(xq, q.t(), xs, F.ScalingType.BlockWise1x128,
                       fp8_gemm.scaled_mm_weight_scale(s), F.ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)[:m]


@cuda
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096)])  # Qwen3-30B-A3B's qkv, o_proj
def test_skinny_fp8_linear_matches_quantize_act_and_scaled_mm(m, n, k):
    torch.manual_seed(4)
    q, s, deq = fp8_weight(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8.quantize_act(x, 128)
    got = fp8_gemm.fp8_linear_skinny(xq, xs, q, s)
    want = scaled_mm_linear(x, q, s)
    print(f"\nskinny FP8 {m}x{n}x{k} ({fp8_gemm.skinny_config(m, n, k)}): relative error "
          f"{rel(got, want):.2e} vs scaled_mm, {rel(got, F.linear(x, deq.to(x.dtype))):.2e} "
          f"vs bf16")
    assert got.dtype == torch.bfloat16 and rel(got, want) < SKINNY_TOL
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    assert rel(got, F.linear(x, deq.to(x.dtype))) < FP8_TOL
    # fp8_linear takes it for these rows; the bias joins before the one rounding
    assert fp8_gemm.skinny_fits(m, q, BLOCK)
    assert torch.equal(fp8_gemm.fp8_linear(x, q, s, BLOCK), got)
    with_bias = fp8_gemm.fp8_linear(x, q, s, BLOCK, bias)
    assert rel(with_bias, want + bias) < SKINNY_TOL


@cuda
def test_skinny_fp8_linear_replays_in_a_cuda_graph():
    """The o_proj shape at 64 rows splits K (float32 partials, summed by each tile's last
    program): captured, then replayed on new rows, it gives the eager result."""
    torch.manual_seed(5)
    q, s, _ = fp8_weight(2048, 4096)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    assert fp8_gemm.skinny_config(64, 2048, 4096)["SPLIT_K"] > 1
    assert fp8_gemm.skinny_fits(64, q, BLOCK)
    fp8_gemm.fp8_linear(x, q, s, BLOCK)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_gemm.fp8_linear(x, q, s, BLOCK)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, fp8_gemm.fp8_linear(x, q, s, BLOCK))


@cuda
@pytest.mark.parametrize("m,n,k", [(1, 5120, 2048), (64, 2048, 4096), (37, 384, 1536)])
def test_skinny_split_k_sums_partials_in_split_order_bit_for_bit(m, n, k):
    """With K split, the last program of a column tile to finish adds the tile's float32
    partials: the result equals, bit for bit, partials from unsplit launches over each K range
    added in split order with the bias, then rounded; in 100 launches and 100 replays of a
    captured graph (a tile summed before all its partials landed, or a counter not set back,
    would differ)."""
    torch.manual_seed(6)
    q, s, _ = fp8_weight(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8.quantize_act(x, 128)
    cfg = fp8_gemm.skinny_config(m, n, k)
    split = cfg["SPLIT_K"]
    assert split == 4
    per = k // 128 // split  # 128-input groups a range
    want = torch.zeros(m, n, device="cuda")
    for r in range(split):
        g = slice(r * per, (r + 1) * per)
        one = dict(cfg, SPLIT_K=1)
        want += fp8_gemm.fp8_linear_skinny(
            xq[:, g.start * 128:g.stop * 128], xs[:, g], q[:, g.start * 128:g.stop * 128],
            s[:, g].contiguous(), None, torch.float32, config=one)
    want = (want + bias.float()).to(torch.bfloat16)
    for _ in range(100):
        assert torch.equal(fp8_gemm.fp8_linear_skinny(xq, xs, q, s, bias), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_gemm.fp8_linear_skinny(xq, xs, q, s, bias)
    for _ in range(100):
        y.zero_()
        graph.replay()
        assert torch.equal(y, want)


@cuda
@pytest.mark.parametrize("rows", [8, 512, 20000])
def test_grouped_fp8_gemm_matches_dequantized_bf16(rows):
    torch.manual_seed(1)
    E, N, K = 16, 1536, 2048
    q, s, deq = fp8_weight(N, K, E)
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    ids = torch.sort(torch.randint(0, E + 1, (rows,), device="cuda")).values  # E: not local
    offs = torch.searchsorted(ids, torch.arange(1, E + 1, device="cuda"))
    xq, xs = fp8.quantize_act(x, 128)
    got = fp8_gemm.grouped_fp8_gemm(xq, xs, q, s, offs, BLOCK)
    assert rel(got, fp8_gemm.grouped_fp8_gemm_ref(xq, xs, q, s, offs, BLOCK,
                                                 torch.float32)) < REF_TOL
    want = torch.zeros(rows, N, device="cuda", dtype=torch.bfloat16)
    start = 0
    for e, end in enumerate(offs.tolist()):
        want[start:end] = x[start:end] @ deq[e].to(torch.bfloat16).t()
        start = end
    assert rel(got, want) < FP8_TOL
    assert not got[int(offs[-1]):].any()  # rows of other ranks' experts stay zero


@cuda
@pytest.mark.parametrize("tma", fp8_gemm.TMA_MODES)
def test_grouped_fp8_gemm_tile_loads_give_the_same_products(tma):
    """TMA or per-element tile loads, each slot's token row read through a_rows or from a
    gathered copy: the same K blocks summed in the same order, so the same bits, and within
    the float32 reference's rounding; rows of other ranks' experts (id E) come out zero."""
    torch.manual_seed(2)
    E, N, K, top_k, tokens = 16, 1536, 2048, 4, 3000
    q, s, _ = fp8_weight(N, K, E)
    xq, xs = fp8.quantize_act(torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16), 128)
    ids, order = torch.sort(torch.randint(0, E + 1, (tokens * top_k,), device="cuda"),
                            stable=True)
    src = order // top_k
    offs = torch.searchsorted(ids, torch.arange(1, E + 1, device="cuda"))
    want = fp8_gemm.grouped_fp8_gemm_ref(xq[src], xs[src], q, s, offs, BLOCK, torch.float32)
    for bm, bn, stages in ((64, 128, 3), (128, 64, 4)):
        cfg = {"BM": bm, "BN": bn, "num_warps": 4, "num_stages": stages}
        base = fp8_gemm.grouped_fp8_gemm(xq[src], xs[src], q, s, offs, BLOCK, config=cfg)
        assert rel(base, want) < REF_TOL
        cfg["TMA"] = tma
        got = fp8_gemm.grouped_fp8_gemm(xq[src], xs[src], q, s, offs, BLOCK, config=cfg)
        assert torch.equal(got, base), (cfg, rel(got, base))
        got = fp8_gemm.grouped_fp8_gemm(xq, xs, q, s, offs, BLOCK, config=cfg, a_rows=src)
        assert torch.equal(got, base), (cfg, "a_rows", rel(got, base))
        assert not got[int(offs[-1]):].any()


@cuda
@pytest.mark.parametrize("limit", [None, 7.0])
def test_grouped_fp8_gemm_swiglu_equals_the_gemm_then_swiglu_quantize(limit):
    """gate/up computing its SwiGLU (swiglu=True, what the FP8 experts run for their own
    SwiGLU, plain or clamped), its [P, I] activation quantized by quantize_act: the codes
    and scales of the unfused GEMM's [P, 2I] gate and up rows through swiglu_quantize, bit
    for bit at the same column tile (the same K blocks summed in the same order, gate and up
    rounded alike); rows of other ranks' experts (id E) zero."""
    torch.manual_seed(3)
    E, inter, K, top_k, tokens = 16, 768, 2048, 4, 3000
    q, s, _ = fp8_weight(2 * inter, K, E)
    xq, xs = fp8.quantize_act(torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16), 128)
    ids, order = torch.sort(torch.randint(0, E + 1, (tokens * top_k,), device="cuda"),
                            stable=True)
    src = order // top_k
    offs = torch.searchsorted(ids, torch.arange(1, E + 1, device="cuda"))
    cfg = fp8_gemm.grouped_fp8_config(src.numel(), E, a_rows=True, swiglu=True)
    act = fp8_gemm.grouped_fp8_gemm(xq, xs, q, s, offs, BLOCK, config=cfg, a_rows=src,
                                    swiglu=True, limit=limit)
    h = fp8_gemm.grouped_fp8_gemm(xq, xs, q, s, offs, BLOCK, config=cfg, a_rows=src)
    assert act.shape == (src.numel(), inter) and h.shape == (src.numel(), 2 * inter)
    want_q, want_s = fp8.swiglu_quantize(h, 128, limit)
    got_q, got_s = fp8.quantize_act(act, 128)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_s, want_s)
    assert not act[int(offs[-1]):].any()


@cuda
@pytest.mark.parametrize("rows", [4, 3000])
def test_fp8_experts_match_bf16_experts_on_dequantized_weights(rows):
    from cpmoe.config import Fp8Config
    from cpmoe.moe.experts import LocalExperts
    from cpmoe.quant.modules import quantize_loaded
    torch.manual_seed(2)
    E, H, inter = 16, 2048, 768
    m = LocalExperts(E, H, inter, torch.bfloat16).cuda()
    torch.nn.init.normal_(m.gate_up_proj, std=0.05)
    torch.nn.init.normal_(m.down_proj, std=0.05)
    quantize_loaded(m, Fp8Config(online=True), keep_fp8=True)
    ref = LocalExperts(E, H, inter, torch.bfloat16).cuda()
    with torch.no_grad():
        for e in range(E):
            ref.gate_up_proj[e] = dequantize(m.gate_up_proj[e], m.gate_up_scale_inv[e], BLOCK)
            ref.down_proj[e] = dequantize(m.down_proj[e], m.down_scale_inv[e], BLOCK)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(-1, E, (rows, 8), device="cuda")
    w = torch.rand(rows, 8, device="cuda", dtype=torch.bfloat16)
    got = m(x, ids, w)
    want = ref.float()._forward_loop(x.float(), ids, w.float())
    assert rel(got, want) < FP8_TOL


# W8A8 decode experts: x and the gated activation are both rounded to e4m3 (3 mantissa bits:
# up to 2^-4 of each element, ~2.4% rms), on top of the weights' own rounding, which both
# sides share; through SiLU(gate) * up and the down GEMM that compounds to ~4-5% (4.3% for
# this test's shape and seed in the interpreter), so the bound is 8%. A wrong scale, stride or
# group scrambles the output (error of order 1). Weights-only FP8 rounds only to bf16.
W8A8_TOL = 8e-2


@cuda
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("block_k", [128, 256])
def test_fused_fp8_experts_match_dequantized_float32(rows, block_k, monkeypatch,
                                                     exact_fp32_matmul):
    """The decode experts (moe/fused_moe.py) on FP8 weights, bf16 rows, in every activation
    mode and with K steps of one or two scale blocks, against float32 on the dequantized
    weights; both W8A8 modes quantize the same numbers, so they agree to rounding."""
    from cpmoe.moe import fused_moe
    torch.manual_seed(3)
    E, H, inter, K = 64, 2048, 768, 8
    q_gu, s_gu, gu = fp8_weight(2 * inter, H, E)
    q_d, s_d, dn = fp8_weight(H, inter, E)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(rows)])
    ids[0, 0] = -1  # another rank's expert
    w = torch.rand(rows, K, device="cuda")
    want = torch.zeros(rows, H, device="cuda")
    for m, k in (ids >= 0).nonzero().tolist():
        g, u = (x[m].float() @ gu[ids[m, k]].t()).chunk(2)
        want[m] += w[m, k] * (dn[ids[m, k]] @ (F.silu(g) * u))
    base = fused_moe.gemm_config
    monkeypatch.setattr(fused_moe, "gemm_config",
                        lambda *a, **kw: dict(base(*a, **kw), BLOCK_K=block_k))
    got = {mode: fused_moe.fused_experts(x, ids, w.to(x.dtype), q_gu, q_d, (s_gu, s_d),
                                         fp8_act=mode) for mode in fused_moe.FP8_ACT_MODES}
    errs = {mode: rel(y, want) for mode, y in got.items()}
    print(f"\nfused FP8 experts, {rows} rows, BLOCK_K {block_k}: relative error {errs}")
    assert all(y.dtype == torch.bfloat16 for y in got.values())
    assert errs["weights"] < REF_TOL
    assert errs["w8a8"] < W8A8_TOL and errs["w8a8-fused"] < W8A8_TOL
    assert rel(got["w8a8-fused"], got["w8a8"]) < REF_TOL


@cuda
@pytest.mark.parametrize("rows", [16, 64, 128])
def test_fused_fp8_experts_tile_variants_give_the_same_bits(rows, monkeypatch):
    """The W8A8 decode experts sum the same products in the same order, so give the same
    bits, with their weight tiles copied by the TMA unit (TMA_W, the down GEMM's default; a
    box of the next expert's rows is never multiplied in) or by per-element loads, for
    several tiles; with several column tiles a program (TILES, a count that leaves the last
    program's tiles masked); and with gate/up writing its gated rows in FP8 with their
    scales (QUANT_OUT, 128-column tiles) instead of a quantize_act launch."""
    from cpmoe.moe import fused_moe
    torch.manual_seed(4)
    E, H, inter, K = 128, 2048, 768, 8
    q_gu, s_gu, _ = fp8_weight(2 * inter, H, E)
    q_d, s_d, _ = fp8_weight(H, inter, E)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(rows)])
    ids[0, 0] = -1  # another rank's expert
    w = torch.rand(rows, K, device="cuda", dtype=torch.bfloat16)
    base = fused_moe.gemm_config

    def run(gate_up: dict, down: dict) -> torch.Tensor:
        monkeypatch.setattr(fused_moe, "gemm_config", lambda *a, gated=True, **kw: dict(
            base(*a, gated=gated, **kw), **(gate_up if gated else down)))
        return fused_moe.fused_experts(x, ids, w, q_gu, q_d, (s_gu, s_d), fp8_act="w8a8")

    for tile in ({}, {"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 8},
                 {"BLOCK_N": 32, "num_stages": 4}):
        by_tma, by_address = (run(dict(tile, TMA_W=t), dict(tile, TMA_W=t)) for t in (True, False))
        assert torch.equal(by_tma, by_address), (rows, tile, rel(by_tma, by_address))
    want = run({"TMA_W": False}, {"TMA_W": False})
    for tiles, tma, block_n, quant_out in ((4, True, 64, False), (5, False, 64, False),
                                           (1, False, 128, True), (2, True, 128, True)):
        tile = {"TILES": tiles, "TMA_W": tma, "BLOCK_N": block_n}
        got = run(dict(tile, QUANT_OUT=quant_out), tile)
        assert torch.equal(got, want), (rows, tiles, tma, block_n, quant_out)


def _fp8_qwen3_checkpoint(tmp_path):
    """A Qwen3-MoE of 128-multiple widths written as a [128, 128] FP8 hub checkpoint."""
    from tests.conftest import make_hf_model
    from tests.e2e._fp8_helpers import write_fp8_checkpoint
    make_hf_model("qwen3_moe", tmp_path, hidden_size=1024, intermediate_size=2048,
                  moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, num_experts=32, num_experts_per_tok=4, vocab_size=4096)
    write_fp8_checkpoint(tmp_path, [128, 128])
    return tmp_path


@cuda
def test_fp8_engine_vs_dequantized_bf16_engine(tmp_path):
    """`cpmoe check`-style: FP8 GEMMs vs the same FP8 checkpoint dequantized to bf16."""
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups
    d = _fp8_qwen3_checkpoint(tmp_path)
    groups = ProcessGroups.single(torch.device("cuda"))
    fp8 = ModelRunner(d, groups, torch.bfloat16, show_progress=False)
    bf16 = ModelRunner(d, groups, torch.bfloat16, show_progress=False, fp8_compute=False)
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.model.parameters())
    assert fp8.weight_bytes() < 0.7 * bf16.weight_bytes()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist()
               for n in (17, 64, 129, 300) * 10]
    got = fp8.prefill(prompts, last_only=True)
    want = bf16.prefill(prompts, last_only=True)
    matches = int((got.argmax(-1) == want.argmax(-1)).sum())
    diff = (got - want).abs().max().item()
    print(f"\nFP8 vs dequantized bf16: first-token matches {matches}/{len(prompts)}, "
          f"max |logit diff| {diff:.3e}, mean {(got - want).abs().mean().item():.3e}")
    # random tiny weights leave small top-2 gaps, which FP8 activations flip: at 5800ba7 on
    # the H200, 30/40 first tokens matched, max |diff| 0.248, mean 0.035; the bounds below
    # leave room for kernel choice, and catch a wrong scale or layout (which scrambles the
    # logits: mean |diff| of order 1, matches by chance, ~1/4096)
    assert matches >= 0.6 * len(prompts)
    assert (got - want).abs().mean().item() < 0.1


@cuda
def test_fp8_decode_takes_the_rows_its_producers_quantized(tmp_path, monkeypatch):
    """In FP8 decode the norms before q/k/v and before the experts, and decode attention
    before o_proj, quantize their rows; the GEMMs after them launch no quantization of their
    own (three launches a layer fewer), with logits bit for bit those of quantizing
    separately, eagerly and in captured decode graphs."""
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups
    d = _fp8_qwen3_checkpoint(tmp_path)
    r = ModelRunner(d, ProcessGroups.single(torch.device("cuda")), torch.bfloat16,
                    show_progress=False)
    layers = r.model.model.layers
    assert all(l.input_layernorm.quant_group == 128 == l.post_attention_layernorm.quant_group
               == l.self_attn.o_quant_group for l in layers)
    launches = []
    real = fp8._quantize_act_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(fp8, "_quantize_act_kernel", Counted())
    gen = torch.Generator().manual_seed(0)
    # 520 keys: decode attention splits the rows (stage 2 runs, and quantizes)
    seqs = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (5, 77, 300, 520)]
    steps = torch.randint(0, 4096, (4, 3), generator=gen).tolist()
    keys = list(range(len(seqs)))

    def decode(fused: bool, graphs: bool) -> tuple[torch.Tensor, int]:
        """3 decode steps' logits and quantize_act launches (none in graph replays)."""
        for l in layers:
            l.input_layernorm.quant_group = l.post_attention_layernorm.quant_group = (
                l.self_attn.o_quant_group) = 128 if fused else None
        r.allocate_kv(4096)
        if graphs:
            r.capture_decode_graphs(4, max_context=1024)
        r.prefill(seqs, keys)
        launches.clear()
        logits = torch.stack([r.decode(keys, [t[i] for t in steps]).clone() for i in range(3)])
        r.graphs = None
        return logits, len(launches)

    (fused, n_fused), (separate, n_separate) = decode(True, False), decode(False, False)
    # a step, separately: q/k/v and o_proj a layer, gate/up (the experts'; a dense MLP's gate
    # and up, two) and down (the LM head stays bf16); fused: down a layer, and the first
    # layer's q/k/v (its input norm has no residual to add: F.rms_norm)
    print(f"\nquantize_act launches in 3 decode steps: {n_separate} separate, {n_fused} fused")
    from cpmoe.models.qwen_moe.model import QwenMoeSparseBlock
    dense = sum(not isinstance(l.mlp, QwenMoeSparseBlock) for l in layers)
    assert n_separate == 3 * (4 * len(layers) + dense)
    assert n_fused == 3 * (len(layers) + 1)
    assert torch.equal(fused, separate)
    # the same in captured decode graphs (what serving replays): an offer that went stale
    # across captures would change the values
    graph_fused, graph_separate = decode(True, True)[0], decode(False, True)[0]
    assert torch.equal(graph_fused, graph_separate)
    # (graphs read a wider block table, so decode attention takes other splits)
    print(f"graphs vs eager, fused: max |logit diff| "
          f"{(graph_fused - fused).abs().max().item():.3e}")


@cuda
def test_decode_with_programmatic_dependent_launch_equals_without(tmp_path, monkeypatch):
    """A decode step's kernels launched with programmatic dependent launch (each placed while
    the one before still runs, waiting for it on the GPU): logits bit for bit those of plain
    launches, FP8 and bf16 (the same checkpoint dequantized), eagerly and in captured decode
    graphs. A kernel touching memory before its wait would read rows not yet written, at
    random."""
    from cpmoe import ops
    from cpmoe.ops import launch
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups
    assert ops.pdl_args(torch.empty(1, device="cuda"))["PDL"] == (
        torch.cuda.get_device_capability()[0] >= 9)
    d = _fp8_qwen3_checkpoint(tmp_path)
    groups = ProcessGroups.single(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    # 12 rows x top-4 = 48 slots >= 32 experts: the expert grid of one program row per
    # expert; 520 and 900 keys: attention splits (stage 2 runs)
    seqs = [torch.randint(0, 4096, (n,), generator=gen).tolist()
            for n in (5, 77, 300, 520, 900, 31, 64, 129, 250, 17, 400, 2)]
    steps = torch.randint(0, 4096, (len(seqs), 4), generator=gen).tolist()
    keys = list(range(len(seqs)))
    for fp8_compute in (True, False):
        r = ModelRunner(d, groups, torch.bfloat16, show_progress=False,
                        fp8_compute=fp8_compute)

        def decode(pdl: bool, graphs: bool) -> torch.Tensor:
            monkeypatch.setattr(launch, "PDL_ENABLED", pdl)  # what CPMOE_PDL sets at import
            r.allocate_kv(8192)
            if graphs:
                r.capture_decode_graphs(len(seqs), max_context=1024)
            r.prefill(seqs, keys)
            logits = torch.stack([r.decode(keys, [t[i] for t in steps]).clone()
                                  for i in range(4)])
            r.graphs = None
            return logits

        for graphs in (False, True):
            assert torch.equal(decode(True, graphs), decode(False, graphs)), (fp8_compute,
                                                                             graphs)
