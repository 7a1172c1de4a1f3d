"""FP8 formats (pure torch) and the FP8 Triton kernels in Triton's CPU interpreter.

Formats: cpmoe.quant.formats against the tests' own loop-based dequantization
(tests/e2e/_fp8_helpers.py): block FP8 with partial last blocks and offsets, ue8m0 scales,
MXFP4 nibble order and scales, and the block quantizer's round trip.

Kernels (a subprocess with TRITON_INTERPRET=1, read at import; skipped without Triton):
the activation quantizer's scales equal the torch reference and its values dequantize to
the input within FP8 rounding; the grouped GEMM equals the float32 product of the same
dequantized operands (empty experts, a tile-straddling expert, rows past the last group
zero); `fp8_linear` through the Triton path equals its reference; and LocalExperts with
FP8 weights equal the float32 loop on the dequantized weights within the FP8 activation
tolerance. The interpreter has no FP8 dot, so the kernel upcasts there; the FP8 dot itself
is checked on the GPU (tests/gpu/test_fp8_cuda.py).
"""

import importlib.util

import pytest
import torch

from cpmoe.quant import formats
from tests._interpreter import run_interpreted
from tests.e2e._fp8_helpers import (dequantize_blocks, dequantize_mxfp4, dequantize_ue8m0_blocks,
                                    quantize_blocks, quantize_mxfp4, quantize_ue8m0_blocks)


@pytest.mark.parametrize("shape,block", [((40, 72), [16, 8]), ((64, 64), [32, 32]),
                                         ((5, 3), [128, 128])])
def test_block_dequantize_matches_loops(shape, block):
    torch.manual_seed(0)
    q, s = quantize_blocks(torch.randn(shape), block)
    want = dequantize_blocks(q, s, block)
    assert torch.equal(formats.dequantize(q, s, tuple(block)), want)
    # a slice starting inside a block reads the grid rows covering it, with an offset
    r0, c0 = 3, 5
    rows, cols = slice(r0, shape[0]), slice(c0, shape[1])
    srows = slice(r0 // block[0], None)
    scols = slice(c0 // block[1], None)
    got = formats.dequantize(q[rows, cols], s[srows, scols], tuple(block),
                             (r0 % block[0], c0 % block[1]))
    assert torch.equal(got, want[rows, cols])


def test_ue8m0_and_mxfp4_dequantize_match_loops():
    torch.manual_seed(1)
    w = torch.randn(24, 64)
    q, e = quantize_ue8m0_blocks(w, [16, 16])
    assert torch.equal(formats.dequantize(q, e, (16, 16)), dequantize_ue8m0_blocks(q, e, [16, 16]))
    packed, e4 = quantize_mxfp4(w)
    want = dequantize_mxfp4(packed, e4)
    assert torch.equal(formats.dequantize(packed, e4, formats.MXFP4_BLOCK), want)
    assert (want - w).abs().max() <= w.abs().max() / 3  # e2m1 is coarse, but not wrong


def test_quantize_block_fp8_round_trip():
    torch.manual_seed(2)
    w = torch.randn(200, 130)
    q, s = formats.quantize_block_fp8(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 2)
    back = formats.dequantize(q, s, (128, 128))
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + s.max() * 2 ** -9).all()
    assert torch.equal(formats.quantize_block_fp8(torch.zeros(3, 3))[1], torch.ones(1, 1))


_CASES = r"""
import torch
from cpmoe.quant import kernels as k
from cpmoe.quant.formats import dequantize, quantize_block_fp8
torch.manual_seed(0)

# activation quantization: scales exact, values within one FP8 step
x = torch.randn(7, 96) * torch.logspace(-2, 2, 7)[:, None]
q, s = k.quantize_act(x, 32)
qr, sr = k.quantize_act_ref(x, 32)
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
    aq, a_s = k.quantize_act_ref(torch.randn(P, K), block[1])
    offs = torch.tensor(offs)
    got = k.grouped_fp8_gemm(aq, a_s, wq, ws, offs, block, out_dtype=torch.float32)
    want = k.grouped_fp8_gemm_ref(aq, a_s, wq, ws, offs, block, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[int(offs[-1]):], torch.zeros_like(got[int(offs[-1]):]))

# Below, activations are quantized by the torch reference (the kernel's carry differs in
# the interpreter, see above), so the GEMM paths are compared exactly.
import cpmoe.quant.experts as fp8_experts_module
def act_ref(x, group=128, rows=None):
    q, s = k.quantize_act_ref(x, group)
    assert rows in (None, x.shape[0])  # padding is for scaled_mm, which is CUDA only
    return q, s.t().contiguous().t()
k.quantize_act = fp8_experts_module.quantize_act = act_ref

# fp8_linear, Triton path (blocks other than 128 x 128), with bias
wq, ws = quantize_block_fp8(torch.randn(48, 64), (16, 32))
x = torch.randn(2, 5, 64)
bias = torch.randn(48)
got = k.fp8_linear(x, wq, ws, (16, 32), bias)
want = k.fp8_linear_ref(x, wq, ws, (16, 32), bias)
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
