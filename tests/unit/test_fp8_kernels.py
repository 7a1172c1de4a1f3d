"""FP8 formats (pure torch) and the FP8 Triton kernels in Triton's CPU interpreter.

Formats: cpmoe.ops.fp8 against the tests' own loop-based dequantization
(tests/e2e/_fp8_helpers.py): block FP8 with partial last blocks and offsets, ue8m0 scales,
MXFP4 nibble order and scales, and the block quantizer's round trip.

Kernels (a subprocess with TRITON_INTERPRET=1, read at import; skipped without Triton):
the activation quantizer's scales equal the torch reference and its values dequantize to
the input within FP8 rounding; the grouped GEMM equals the float32 product of the same
dequantized operands (empty experts, a tile-straddling expert, rows past the last group
zero); `fp8_linear` through the Triton path equals its reference; LocalExperts with
FP8 weights equal the float32 loop on the dequantized weights within the FP8 activation
tolerance; and the skinny decode GEMM (its own row quantization, split K, bias, a ragged
last scale block) equals a float64 product of the test's own quantized operands, and is
what `fp8_linear` runs for few rows. The interpreter has no FP8 dot, so the kernels upcast
there; the FP8 dot itself is checked on the GPU (tests/gpu/test_fp8_cuda.py).
"""

import importlib.util

import pytest
import torch

from cpmoe.ops import fp8
from tests._interpreter import run_interpreted
from tests.e2e._fp8_helpers import (dequantize_blocks, dequantize_mxfp4, dequantize_ue8m0_blocks,
                                    quantize_blocks, quantize_mxfp4, quantize_ue8m0_blocks)


@pytest.mark.parametrize("shape,block", [((40, 72), [16, 8]), ((64, 64), [32, 32]),
                                         ((5, 3), [128, 128])])
def test_block_dequantize_matches_loops(shape, block):
    torch.manual_seed(0)
    q, s = quantize_blocks(torch.randn(shape), block)
    want = dequantize_blocks(q, s, block)
    assert torch.equal(fp8.dequantize(q, s, tuple(block)), want)
    # a slice starting inside a block reads the grid rows covering it, with an offset
    r0, c0 = 3, 5
    rows, cols = slice(r0, shape[0]), slice(c0, shape[1])
    srows = slice(r0 // block[0], None)
    scols = slice(c0 // block[1], None)
    got = fp8.dequantize(q[rows, cols], s[srows, scols], tuple(block),
                             (r0 % block[0], c0 % block[1]))
    assert torch.equal(got, want[rows, cols])


def test_ue8m0_and_mxfp4_dequantize_match_loops():
    torch.manual_seed(1)
    w = torch.randn(24, 64)
    q, e = quantize_ue8m0_blocks(w, [16, 16])
    assert torch.equal(fp8.dequantize(q, e, (16, 16)), dequantize_ue8m0_blocks(q, e, [16, 16]))
    packed, e4 = quantize_mxfp4(w)
    want = dequantize_mxfp4(packed, e4)
    assert torch.equal(fp8.dequantize(packed, e4, fp8.MXFP4_BLOCK), want)
    assert (want - w).abs().max() <= w.abs().max() / 3  # e2m1 is coarse, but not wrong


def test_quantize_block_fp8_round_trip():
    torch.manual_seed(2)
    w = torch.randn(200, 130)
    q, s = fp8.quantize_block_fp8(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2)
    back = fp8.dequantize(q, s, (128, 128))
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + s.max() * 2 ** -9).all()
    assert torch.equal(fp8.quantize_block_fp8(torch.zeros(3, 3))[1], torch.ones(1, 1))


def test_quantize_act_takes_an_offer_only_for_the_same_unwritten_rows():
    """`offer_quantized`: quantize_act returns the offered (q, s) for the offered rows (padded
    with zero rows when asked for more), and computes afresh for other memory, a different
    view, rows written since, another group, or once the rows are freed."""
    import gc
    from cpmoe.ops import fp8
    from cpmoe.ops.fp8 import offer_quantized
    torch.manual_seed(0)
    x = torch.randn(4, 256)
    q, s = fp8.quantize_act_ref(x, 128)
    q, s = q.clone(), s.t().contiguous().t()
    offer_quantized(x, q, s, 128)
    got = fp8.quantize_act(x, 128)
    assert got[0] is q and got[1] is s
    assert fp8.quantize_act(x.view(4, 256), 128)[0] is q  # another view of the same rows
    for other in (x.clone(), x[1:], x.view(8, 128)):
        assert fp8.quantize_act(other, 128)[0] is not q
    assert fp8.quantize_act(x, 64)[0] is not q
    # padded: the offer's rows, then zero codes and scales (the kernel's padding)
    pq, ps = fp8.quantize_act(x, 128, rows=8)
    assert pq.shape == (8, 256) and ps.shape == (8, 2) and ps.stride() == (1, 8)
    assert torch.equal(pq[:4].view(torch.uint8), q.view(torch.uint8))
    assert not pq[4:].view(torch.uint8).any() and torch.equal(ps[:4], s) and not ps[4:].any()
    # an offer of other codes than quantize_act's (FP8 attention's O: per-tensor scales)
    # comes back as offered, padded or not
    t = x.abs().max() / 448
    q_t, s_t = (x / t).to(torch.float8_e4m3fn), torch.full((2, 4), float(t)).t()
    offer_quantized(x, q_t, s_t, 128)
    pq, ps = fp8.quantize_act(x, 128, rows=5)
    assert torch.equal(pq[:4].view(torch.uint8), q_t.view(torch.uint8))
    assert not torch.equal(q_t.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(ps[:4], s_t) and fp8.quantize_act(x, 128)[0] is q_t
    offer_quantized(x, q, s, 128)
    x.mul_(2)  # written since the offer: the old values must not come back
    q2, s2 = fp8.quantize_act(x, 128)
    assert q2 is not q and torch.equal(s2, 2 * s)
    y = torch.randn(2, 128)
    offer_quantized(y, *fp8.quantize_act_ref(y, 128), 128)
    del y
    gc.collect()
    z = torch.randn(2, 128)  # may reuse the freed memory: z's own scales come back
    assert torch.equal(fp8.quantize_act(z, 128)[1], fp8.quantize_act_ref(z, 128)[1])


_CASES = r"""
import torch
from cpmoe.ops import fp8, fp8_gemm
from cpmoe.ops.fp8 import dequantize, quantize_block_fp8
torch.manual_seed(0)

# activation quantization: scales exact, values within one FP8 step
x = torch.randn(7, 96) * torch.logspace(-2, 2, 7)[:, None]
q, s = fp8.quantize_act(x, 32)
qr, sr = fp8.quantize_act_ref(x, 32)
assert torch.equal(s, sr) and s.stride() == (1, 7), (s.stride(),)
# The interpreter's float32 -> fp8 cast drops the carry when rounding up crosses a power of
# two (126.8 -> 64, not 128; the GPU's cvt is right): only those elements may differ.
qf, rf = q.float(), qr.float()
carry = (rf.abs().log2() == rf.abs().log2().round()) & (qf == rf / 2)
assert ((qf == rf) | carry).all() and carry.float().mean() < 0.05

def experts_weights(E, N, K, block):
    w = torch.randn(E, N, K)
    pairs = [quantize_block_fp8(w[e], block) for e in range(E)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

# grouped GEMM: empty experts, an expert over several row tiles, rows past the last group
for P, E, N, K, block, offs in ((21, 3, 80, 64, (16, 32), [7, 7, 20]),
                                (40, 4, 48, 128, (16, 16), [0, 35, 35, 38])):
    wq, ws = experts_weights(E, N, K, block)
    aq, a_s = fp8.quantize_act_ref(torch.randn(P, K), block[1])
    offs = torch.tensor(offs)
    got = fp8_gemm.grouped_fp8_gemm(aq, a_s, wq, ws, offs, block, out_dtype=torch.float32)
    want = fp8_gemm.grouped_fp8_gemm_ref(aq, a_s, wq, ws, offs, block, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[int(offs[-1]):], torch.zeros_like(got[int(offs[-1]):]))
# 128 x 128 blocks (one weight scale a tile): the kernel keeps each row's sum in units of the
# current K block's scales, rescaling it block to block, so rows whose 128-groups span 1e8
# in scale, an all-zero group (the 1e-12 scale) and a weight block of scale 0 move it most;
# within float32's rounding of the sum of |terms|, row by row, plain and with the SwiGLU
P, E, N, K, block = 24, 2, 256, 512, (128, 128)
rng = torch.get_rng_state()  # the cases after this one keep their draws
x = torch.randn(P, K) * (10.0 ** torch.randint(-4, 5, (P, K // 128))).repeat_interleave(128, 1)
x[3, 128:256] = 0
wq, ws = experts_weights(E, N, K, block)
ws[1, 0, 2] = 0
torch.set_rng_state(rng)
aq, a_s = fp8.quantize_act_ref(x, 128)
offs = torch.tensor([10, 24])
want = fp8_gemm.grouped_fp8_gemm_ref(aq, a_s, wq, ws, offs, block, torch.float32)
bound = fp8_gemm.grouped_fp8_gemm_ref(aq.float().abs().to(aq.dtype), a_s,
                                      wq.float().abs().to(wq.dtype), ws, offs, block,
                                      torch.float32)
for cfg in ({"BM": 16, "BN": 128, "num_warps": 4, "num_stages": 1},
            {"BM": 16, "BN": 64, "num_warps": 4, "num_stages": 1}):
    got = fp8_gemm.grouped_fp8_gemm(aq, a_s, wq, ws, offs, block, torch.float32, config=cfg)
    assert ((got - want).abs() <= 1e-5 * bound.amax(1, keepdim=True)).all()
    g, u = want[:, :N // 2], want[:, N // 2:]
    got = fp8_gemm.grouped_fp8_gemm(aq, a_s, wq, ws, offs, block, torch.float32, config=cfg,
                                    swiglu=True)
    gate_bound, up_bound = bound[:, :N // 2], bound[:, N // 2:]
    tol = 1e-5 * gate_bound.amax(1, keepdim=True) * up_bound.amax(1, keepdim=True)
    assert ((got - g / (1 + torch.exp(-g)) * u).abs() <= tol).all()
# weights the kernel would have to copy every call: refused, with their strides
try:
    fp8_gemm.grouped_fp8_gemm(aq, a_s, wq.transpose(1, 2).contiguous().transpose(1, 2), ws,
                              offs, block)
    raise AssertionError("non-contiguous weights were taken")
except ValueError as e:
    assert "must be contiguous" in str(e), e

# Below, activations are quantized by the torch reference (the kernel's carry differs in
# the interpreter, see above), so the GEMM paths are compared exactly.
import cpmoe.moe.fp8_experts as fp8_experts_module
def act_ref(x, group=128, rows=None):
    q, s = fp8.quantize_act_ref(x, group)
    assert rows in (None, x.shape[0])  # padding is for scaled_mm, which is CUDA only
    return q, s.t().contiguous().t()
fp8.quantize_act = fp8_gemm.quantize_act = fp8_experts_module.quantize_act = act_ref

# fp8_linear, Triton path (blocks other than 128 x 128), with bias
wq, ws = quantize_block_fp8(torch.randn(48, 64), (16, 32))
x = torch.randn(2, 5, 64)
bias = torch.randn(48)
got = fp8_gemm.fp8_linear(x, wq, ws, (16, 32), bias)
want = fp8_gemm.fp8_linear_ref(x, wq, ws, (16, 32), bias)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

# LocalExperts with FP8 weights vs the float32 loop on the dequantized weights (FP8
# activations: a few percent)
from cpmoe.config import Fp8Config
from cpmoe.moe.experts import LocalExperts
from cpmoe.quant.modules import quantize_loaded
M, Kt, E, H, I = 9, 2, 4, 64, 32
m = LocalExperts(E, H, I, torch.float32)
torch.nn.init.normal_(m.gate_up_proj, std=0.2)
torch.nn.init.normal_(m.down_proj, std=0.2)
ref = LocalExperts(E, H, I, torch.float32)
quantize_loaded(m, Fp8Config(block=(16, 16), online=True), keep_fp8=True)
assert m.gate_up_proj.dtype == torch.float8_e4m3fn
with torch.no_grad():
    for e in range(E):
        ref.gate_up_proj[e] = dequantize(m.gate_up_proj[e], m.gate_up_scale_inv[e], (16, 16))
        ref.down_proj[e] = dequantize(m.down_proj[e], m.down_scale_inv[e], (16, 16))
x = torch.randn(M, H)
ids = torch.stack([torch.randperm(E + 1)[:Kt] for _ in range(M)]) - 1  # some -1
w = torch.rand(M, Kt)
got = m(x, ids, w)
want = ref._forward_loop(x, ids, w)
rel = ((got - want).norm() / want.norm()).item()
assert rel < 3e-2, rel
# EP with many slots (prefill): the local slot count is read and other ranks' slots skipped
import cpmoe.moe.experts
cpmoe.moe.experts._SYNC_MIN_SLOTS = 4
m.shard = ref.shard = (0, 2, 0, 1)
got = m(x, ids, w)
assert ((got - want).norm() / want.norm()).item() < 3e-2
none = torch.full_like(ids, -1)
assert torch.equal(m(x, none, w), torch.zeros_like(x))
print("fp8 kernels ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_fp8_kernels_match_references_in_the_interpreter() -> None:
    out = run_interpreted(_CASES, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fp8 kernels ok" in out.stdout


_SKINNY_CASES = r"""
import torch
from cpmoe.ops import fp8, fp8_gemm
FP8 = torch.float8_e4m3fn
torch.manual_seed(0)


def exact_rows(M, K):
    # rows whose 1 x 128 quantization is exact: FP8 values times a power of two per group,
    # 448 in every group, and one all-zero group (the 1e-12 scale). The interpreter's
    # float32 -> FP8 cast drops the carry when rounding up crosses a power of two (see
    # _CASES), the GPU's does not; exact rows leave it nothing to round.
    q = (torch.randn(M, K) * 64).clamp(-448, 448).to(FP8).float()
    q[:, ::128] = 448.0
    x = q * 2.0 ** torch.randint(-10, -4, (M, K // 128)).float().repeat_interleave(128, 1)
    x[M // 2, :128] = 0.0
    return x


def reference(x, w, w_scale, bias):
    # the test's own: rows quantized per 1 x 128 group, weights dequantized by their
    # 128 x 128 block scales, float64 matmul
    M, K = x.shape
    g = x.double().view(M, K // 128, 128)
    s = (g.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    xq = ((g / s).clamp(-448, 448).to(FP8).double() * s).view(M, K)
    N = w.shape[0]
    scale = w_scale.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
    y = xq @ (w.double() * scale).t()
    return y if bias is None else y + bias.double()


# (N, K): fewer inputs than outputs, and the other way with N not whole 128-row blocks
# (fp8_linear takes those too); every row count class; bias or not; the default tiles and
# split K over 1, 2 and 4 ranges (4 ranges of 3 groups: the last one empty), 32 or 64 columns
configs = [None, dict(BLOCK_N=64, SPLIT_K=2, num_warps=4, num_stages=3),
           dict(BLOCK_N=32, SPLIT_K=4, num_warps=4, num_stages=3)]
case = 0
for N, K in ((384, 256), (200, 384)):
    w = (torch.randn(N, K) * 100).clamp(-448, 448).to(FP8)
    w_scale = torch.rand(-(-N // 128), K // 128) * 1e-3 + 1e-4
    for M in (1, 5, 16, 64):
        x = exact_rows(M, K)
        for bias in (None, torch.randn(N)):
            cfg = configs[case % len(configs)]
            case += 1
            xq, xs = fp8.quantize_act(x, 128)
            got = fp8_gemm.fp8_linear_skinny(xq, xs, w, w_scale, bias, torch.float32, config=cfg)
            want = reference(x, w, w_scale, bias)
            assert got.shape == (M, N) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-5,
                                       atol=1e-5 * want.abs().max().item())
            assert fp8_gemm.skinny_fits(M, w, (128, 128))
            if cfg is None:  # fp8_linear takes it for these rows, over any leading dims
                lin = fp8_gemm.fp8_linear(x.view(1, M, K), w, w_scale, (128, 128), bias)
                assert torch.equal(lin.view(M, N), got)
assert case == 16
# bf16 out (the default): the interpreter's float32 -> bf16 cast truncates (the GPU's
# rounds), so within one bf16 step of the float32 result
x = exact_rows(5, 256)
w, w_scale = w[:, :256], w_scale[:, :2].contiguous()
xq, xs = fp8.quantize_act(x, 128)
got = fp8_gemm.fp8_linear_skinny(xq, xs, w, w_scale)
assert got.dtype == torch.bfloat16
torch.testing.assert_close(got.float(), fp8_gemm.fp8_linear_skinny(xq, xs, w, w_scale, None,
                                                            torch.float32),
                           rtol=2 ** -7, atol=0)
# not taken: more rows than one tile holds, other blocks, K off the activation groups
assert not fp8_gemm.skinny_fits(fp8_gemm.SKINNY_ROWS + 1, w, (128, 128))
assert not fp8_gemm.skinny_fits(5, w, (16, 32)) and not fp8_gemm.skinny_fits(0, w, (128, 128))
assert not fp8_gemm.skinny_fits(5, torch.empty(128, 200, dtype=FP8), (128, 128))
try:  # rows not quantized
    fp8_gemm.fp8_linear_skinny(x, xs, w, w_scale)
    raise AssertionError("float rows were taken")
except ValueError as e:
    assert "FP8 rows" in str(e)
print("skinny fp8 ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_skinny_fp8_linear_matches_a_float64_reference_in_the_interpreter() -> None:
    out = run_interpreted(_SKINNY_CASES, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skinny fp8 ok" in out.stdout
