"""The decode experts' Triton kernels (moe/fused_moe.py) against the experts' loop path, one
matmul pair per expert in float32 (Triton's CPU interpreter, in a subprocess since
TRITON_INTERPRET is read at import; skipped where Triton is not installed), and its W8A8 modes
for FP8 weights against float32 with the activations quantized per 1 x 128 group. The GPU
tests in tests/gpu/test_cuda_paths.py and tests/gpu/test_fp8_cuda.py check bf16 on CUDA."""

import importlib.util

import pytest

from tests._interpreter import run_interpreted

_CASES = r"""
import torch
from cpmoe.moe import fused_moe
from cpmoe.moe.experts import LocalExperts
assert fused_moe.usable(torch.zeros(1), 1), "interpreter not active"
torch.manual_seed(0)
# (rows, top-k, local experts, hidden, intermediate): a row per expert and several rows on
# one expert (more than a 16-row tile), widths off the tile sizes, other ranks' slots (-1);
# fewer slots than experts (2 x 3 < 20: the compact grid, as at batch 1 on 128 experts)
for M, K, E, H, I in ((3, 2, 4, 48, 40), (40, 4, 3, 160, 72), (5, 3, 8, 32, 16),
                      (2, 3, 20, 32, 24)):
    assert fused_moe.gemm_config(M * K, E, H)["COMPACT"] == (M * K < E)
    m = LocalExperts(E, H, I, torch.float32)
    torch.nn.init.normal_(m.gate_up_proj, std=0.2)
    torch.nn.init.normal_(m.down_proj, std=0.2)
    x = torch.randn(M, H)
    ids = torch.stack([torch.randperm(E + 2)[:K] for _ in range(M)]) - 2  # some -1 and -2
    ids = torch.where(ids < 0, -1, ids)
    w = torch.rand(M, K)
    want = m._forward_loop(x, ids, w)
    got = fused_moe.fused_experts(x, ids, w, m.gate_up_proj, m.down_proj)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    none = torch.full_like(ids, -1)  # no slot on this rank: zeros, nothing read
    assert torch.equal(fused_moe.fused_experts(x, none, w, m.gate_up_proj, m.down_proj),
                       torch.zeros_like(x))
# FP8 weights with 128 x 128 block scales (weights-only: x stays float32 here) against the
# loop over the dequantized weights; 2 x 2 blocks of gate, of up and of down
from cpmoe.ops.fp8 import dequantize, quantize_block_fp8
E, H, I = 3, 256, 256
m = LocalExperts(E, H, I, torch.float32)
torch.nn.init.normal_(m.gate_up_proj, std=0.05)
torch.nn.init.normal_(m.down_proj, std=0.05)
qs = [[quantize_block_fp8(w[e]) for e in range(E)] for w in (m.gate_up_proj, m.down_proj)]
q_gu, q_d = (torch.stack([q for q, _ in ws]) for ws in qs)
s_gu, s_d = (torch.stack([s for _, s in ws]) for ws in qs)
m.gate_up_proj.data = torch.stack([dequantize(q, s, (128, 128)) for q, s in qs[0]])
m.down_proj.data = torch.stack([dequantize(q, s, (128, 128)) for q, s in qs[1]])
x, ids, w = torch.randn(7, H), torch.randint(-1, E, (7, 2)), torch.rand(7, 2)
want = m._forward_loop(x, ids, w)
got = fused_moe.fused_experts(x, ids, w, q_gu, q_d, (s_gu, s_d), fp8_act="weights")
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
# DeepSeek-V4's clamped SwiGLU (limit 0.5 clamps many of these gate/up values)
m = LocalExperts(4, 64, 32, torch.float32)
torch.nn.init.normal_(m.gate_up_proj, std=0.3)
torch.nn.init.normal_(m.down_proj, std=0.3)
m.swiglu_limit = 0.5
x, ids, w = torch.randn(6, 64), torch.randint(-1, 4, (6, 3)), torch.rand(6, 3)
want = m._forward_loop(x, ids, w)
got = fused_moe.fused_experts(x, ids, w, m.gate_up_proj, m.down_proj, swiglu_limit=0.5)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
m.swiglu_limit = None
assert not torch.allclose(got, m._forward_loop(x, ids, w), atol=1e-3)  # the clamp mattered
print("fused moe ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_fused_decode_experts_match_the_loop_in_the_interpreter() -> None:
    out = run_interpreted(_CASES, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused moe ok" in out.stdout


_W8A8_CASES = r"""
import torch
import torch.nn.functional as F
from cpmoe.moe import fused_moe
from cpmoe.ops.fp8 import FP8, dequantize, quantize_block_fp8
from cpmoe.ops.fp8 import quantize_act_ref
torch.manual_seed(0)


def fake_quant(x):  # the 1 x 128 activation recipe, written out: x as its FP8 value
    g = x.view(x.shape[0], -1, 128)
    s = (g.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return ((g / s).clamp(-448, 448).to(FP8).float() * s).view_as(x)


def fp8_weights(E, N, K):
    pairs = [quantize_block_fp8(torch.randn(N, K) * 0.05) for _ in range(E)]
    q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    return q, s, torch.stack([dequantize(q[e], s[e], (128, 128)) for e in range(E)])


def exact_rows(M, K):
    # rows whose 1 x 128 quantization is exact (an FP8 value times a power of two, 448 in
    # every group): the interpreter's float32 -> FP8 cast drops the carry when rounding up
    # crosses a power of two (see test_fp8_kernels), the GPU's does not; exact rows leave it
    # nothing to round, so kernel-side quantization is compared exactly
    q = (torch.randn(M, K) * 64).clamp(-448, 448).to(FP8).float()
    q[:, ::128] = 448.0
    return q * 2.0 ** torch.randint(-10, -6, (M, 1)).float()


def gemm(a, w, s, ids, gated, mode, block_k, limit=None, tma=False):
    # one expert GEMM of the decode path -> [slots, N] float32; NaN where no slot wrote
    E, n_rows, k_dim = w.shape
    M, K = ids.shape
    P = M * K
    slots = torch.empty(E, P, dtype=torch.int32)
    counts = torch.empty(E, dtype=torch.int32)
    fused_moe._align_kernel[(E,)](ids.reshape(P), slots, counts, P, P, BLOCK_P=64)
    out = torch.full((P, n_rows // 2 if gated else n_rows), float("nan"))
    cfg = dict(fused_moe.gemm_config(P, E, k_dim, fp8=True, fp8_act=mode), BLOCK_K=block_k,
               TMA_W=tma)
    fused_moe._gemm(a, w, slots, counts, out, K, row_of_slot=gated, gated=gated, config=cfg,
                    scale=s, limit=limit)
    return out


def gate_up_ref(x, gu, e, limit=None):
    g, u = (fake_quant(x) @ gu[e].t()).chunk(2, dim=-1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


# GEMM by GEMM, both W8A8 modes, K steps of one and of two scale blocks, the weight tiles
# by address and by TMA descriptor; (rows, top-k, experts, hidden, intermediate):
# one row on fewer slots than experts (COMPACT), a few rows, and more rows on one expert
# than a 64-row tile; a slot of another rank (-1)
for M, K, E, H, I in ((1, 2, 4, 256, 128), (6, 3, 4, 256, 256), (80, 2, 2, 256, 128)):
    q_gu, s_gu, gu = fp8_weights(E, 2 * I, H)
    q_d, s_d, dn = fp8_weights(E, H, I)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
    ids[M // 2, K - 1] = -1
    routed = (ids.reshape(-1) >= 0).nonzero().squeeze(1)
    x, act = exact_rows(M, H), exact_rows(M * K, I)
    for mode, tma in (("w8a8", False), ("w8a8", True), ("w8a8-fused", True)):
        for block_k, limit in ((128, None), (256, 0.5)):
            got = gemm(x, q_gu, s_gu, ids, True, mode, block_k, limit, tma)
            assert got[~(ids.reshape(-1) >= 0)].isnan().all()  # not written
            for p in routed.tolist():
                want = gate_up_ref(x[p // K:p // K + 1], gu, ids.reshape(-1)[p], limit)
                torch.testing.assert_close(got[p:p + 1], want, rtol=1e-4, atol=1e-5)
            if I % block_k:
                continue
            got = gemm(act, q_d, s_d, ids, False, mode, block_k, tma=tma)
            for p in routed.tolist():
                want = fake_quant(act[p:p + 1]) @ dn[ids.reshape(-1)[p]].t()
                torch.testing.assert_close(got[p:p + 1], want, rtol=1e-4, atol=1e-5)
    assert fused_moe.gemm_config(M * K, E, H)["COMPACT"] == (M * K < E)

# The whole path (x and the gated output quantized, the routing-weighted sum) in "w8a8"
# mode against float32 with the activations quantized as above, clamped SwiGLU included.
# Its quantize_act is the torch one here (the interpreter's cast, see exact_rows); the
# activations are random, so the kernel's and the reference's float32 sums may put one
# gated output on either side of an FP8 rounding step: a relative error bound, not exact.
fused_moe.quantize_act = lambda a, group: (lambda q, s: (q, s.t().contiguous().t()))(
    *quantize_act_ref(a, group))
for M, K, E, H, I, limit in ((1, 2, 4, 256, 128, None), (12, 4, 6, 256, 256, 0.5)):
    q_gu, s_gu, gu = fp8_weights(E, 2 * I, H)
    q_d, s_d, dn = fp8_weights(E, H, I)
    x, w = torch.randn(M, H), torch.rand(M, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
    ids[0, 0] = -1
    want = torch.zeros(M, H)
    for m, k in (ids >= 0).nonzero().tolist():
        e = ids[m, k]
        want[m] += w[m, k] * (fake_quant(gate_up_ref(x[m:m + 1], gu, e, limit))
                              @ dn[e].t())[0]
    got = fused_moe.fused_experts(x, ids, w, q_gu, q_d, (s_gu, s_d), limit, fp8_act="w8a8")
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-3, err
    weights_only = fused_moe.fused_experts(x, ids, w, q_gu, q_d, (s_gu, s_d), limit,
                                           fp8_act="weights")
    assert ((weights_only - want).norm() / want.norm()).item() > 1e-2  # FP8 rows mattered

# The weight tiles by TMA and by address: the same products in the same order, so the same
# bits, over K steps of one and of two scale blocks, two steps or more per GEMM (rows of
# random values: each 128-input group has its own scale, so a group's scale read for
# another's shows)
M, K, E, H, I = 12, 4, 6, 512, 256
q_gu, s_gu, _ = fp8_weights(E, 2 * I, H)
q_d, s_d, _ = fp8_weights(E, H, I)
x, w = torch.randn(M, H), torch.rand(M, K)
ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
base = fused_moe.gemm_config
for block_k in (128, 256):
    def tile(slots, experts, k_dim, *a, tma, **kw):
        bk = block_k if k_dim >= 2 * block_k else 128
        return dict(base(slots, experts, k_dim, *a, **kw), BLOCK_K=bk, TMA_W=tma)
    got = []
    for tma in (True, False):
        fused_moe.gemm_config = lambda *a, **kw: tile(*a, tma=tma, **kw)
        got.append(fused_moe.fused_experts(x, ids, w, q_gu, q_d, (s_gu, s_d), 0.5,
                                           fp8_act="w8a8"))
    assert torch.equal(*got), block_k
fused_moe.gemm_config = base

# A program's column tiles in one loop (TILES, N not a multiple of the tiles a program: the
# last program's extra tiles are masked) and gate/up quantizing its gated rows as it writes
# them (QUANT_OUT): the same products in the same order, so the same bits as one tile a
# program and a quantize_act launch, with the weight tiles by address and by TMA (both
# quantizations the Triton one here: the interpreter's cast is not the GPU's, see
# exact_rows, but it is the same on both sides)
from cpmoe.ops.fp8 import quantize_act
fused_moe.quantize_act = quantize_act
got = []
for tiles, tma, block_n, quant_out in ((1, False, 64, False), (3, False, 64, False),
                                       (3, True, 64, False), (1, False, 128, True),
                                       (2, True, 128, True)):
    def tile(slots, experts, k_dim, *a, gated=True, **kw):
        return dict(base(slots, experts, k_dim, *a, gated=gated, **kw), TILES=tiles,
                    TMA_W=tma, BLOCK_N=block_n, QUANT_OUT=quant_out and gated)
    fused_moe.gemm_config = tile
    got.append(fused_moe.fused_experts(x, ids, w, q_gu, q_d, (s_gu, s_d), 0.5,
                                       fp8_act="w8a8"))
    assert torch.equal(got[0], got[-1]), (tiles, tma, block_n, quant_out)
fused_moe.gemm_config = base
# QUANT_OUT's rows and scales are quantize_act's of the gated rows gate/up writes without it
P = M * K
slots, counts = torch.empty(E, P, dtype=torch.int32), torch.empty(E, dtype=torch.int32)
fused_moe._align_kernel[(E,)](ids.reshape(P), slots, counts, P, P, BLOCK_P=64)
cfg = base(P, E, H, True, "w8a8")
plain = torch.empty(P, I)
fused_moe._gemm(x, q_gu, slots, counts, plain, K, True, True, config=cfg, scale=s_gu)
q8, s8 = torch.empty(P, I, dtype=FP8), torch.empty(I // 128, P)
fused_moe._gemm(x, q_gu, slots, counts, q8, K, True, True, scale=s_gu, out_scale=s8,
                config=dict(cfg, BLOCK_N=128, QUANT_OUT=True))
want_q, want_s = quantize_act(plain, 128)
assert torch.equal(q8.view(torch.uint8), want_q.view(torch.uint8))
assert torch.equal(s8.t(), want_s)
try:  # a 64-column tile holds half an activation group: refused in one line
    fused_moe._gemm(x, q_gu, slots, counts, q8, K, True, True, scale=s_gu, out_scale=s8,
                    config=dict(cfg, BLOCK_N=64, QUANT_OUT=True))
except ValueError as e:
    assert "QUANT_OUT takes the gated GEMM's 128-column tiles" in str(e), e
else:
    raise AssertionError("QUANT_OUT took 64-column tiles")

# TMA_W reads the weights through one descriptor over [E * N, K]: non-contiguous ones are
# refused in one line naming the option, before any launch
try:
    gemm(x[:, :256], q_gu[:, :, :256], s_gu[:, :, :2], ids, True, "w8a8", 128, tma=True)
except ValueError as e:
    assert "TMA_W needs contiguous weights" in str(e), e
else:
    raise AssertionError("TMA_W took non-contiguous weights")
print("w8a8 ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_w8a8_decode_experts_match_a_float32_reference_in_the_interpreter() -> None:
    out = run_interpreted(_W8A8_CASES, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "w8a8 ok" in out.stdout
