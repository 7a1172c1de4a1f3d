"""Fused ops: the torch reference expressions against what the model did before them, and
the Triton kernels against the references (Triton's CPU interpreter, in a subprocess since
TRITON_INTERPRET is read at import; skipped where Triton is not installed)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from cpmoe import ops
from tests._interpreter import run_interpreted


def test_references_match_the_plain_expressions() -> None:
    torch.manual_seed(0)
    h = torch.randn(5, 12)
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul_ref(h), F.silu(gate) * up)

    y, idx, w = torch.randn(7, 6), torch.randint(0, 7, (4, 3)), torch.rand(4, 3)
    want = torch.stack([sum(w[m, k] * y[idx[m, k]] for k in range(3)) for m in range(4)])
    torch.testing.assert_close(ops.weighted_row_sum_ref(y, idx, w), want)
    # rows 0-2 are read only by zero-weight slots (another rank's experts): memory no GEMM
    # wrote, NaN here, must not reach the sum
    idx0 = torch.tensor([[0, 3, 4], [1, 5, 6], [2, 3, 5], [0, 4, 6]])
    y_nan, w0 = y.clone(), w.clone()
    y_nan[:3] = float("nan")
    w0[:, 0] = 0
    want0 = torch.stack([w0[m, 1] * y[idx0[m, 1]] + w0[m, 2] * y[idx0[m, 2]] for m in range(4)])
    torch.testing.assert_close(ops.weighted_row_sum_ref(y_nan, idx0, w0), want0)

    x, weight = torch.randn(3, 2, 8), torch.rand(8)
    cos, sin = torch.rand(3, 4).repeat(1, 2), torch.rand(3, 4).repeat(1, 2)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    rotated = torch.cat([-normed[..., 4:], normed[..., :4]], dim=-1)
    want = normed * cos[:, None] + rotated * sin[:, None]  # HF's rotate_half form
    torch.testing.assert_close(ops.norm_rope_ref(x, weight, 1e-6, cos, sin), want)

    x, r = torch.randn(3, 8), torch.randn(3, 8)
    s = x + r
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    out, summed = ops.add_rms_norm_ref(x, r, weight, 1e-6)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(summed, s)
    # the decode QKV path is norm_rope on q and k (checked above) plus plain stores
    qkv, slots = torch.randn(3, 4 * 8), torch.tensor([5, 0, 2])
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    q = ops.qkv_norm_rope_store_ref(qkv, 2, 1, weight, weight, 1e-6, cos, sin, k_cache,
                                    v_cache, slots)
    torch.testing.assert_close(q, ops.norm_rope_ref(qkv[:, :16].view(3, 2, 8), weight, 1e-6,
                                                    cos, sin))
    k = ops.norm_rope_ref(qkv[:, 16:24].view(3, 1, 8), weight, 1e-6, cos, sin)
    torch.testing.assert_close(k_cache.view(8, 1, 8)[slots], k)
    torch.testing.assert_close(v_cache.view(8, 1, 8)[slots], qkv[:, 24:].view(3, 1, 8))
    assert k_cache.view(8, -1)[[1, 3, 4, 6, 7]].abs().sum() == 0


def test_fp8_kv_pools_round_to_nearest_and_saturate() -> None:
    """--kv-cache-dtype fp8 (scale 1): values by hand. e4m3: 0.3 = 0.25 x 1.2 -> 0.25 x
    (1 + 2/8) = 0.3125; past 448 (1.75 x 2^8) it saturates. e5m2: 0.3 -> 0.25 x (1 + 1/4);
    60000 lies nearer 57344 (1.75 x 2^15) than 65536 (past the format); torch's own e5m2 cast
    would give inf for 70000."""
    x = torch.tensor([0.3, 500.0, -1000.0, 448.0, 0.0, 60000.0, -1e6])
    e4 = ops.to_kv_cache(x, torch.float8_e4m3fn)
    assert e4.dtype == torch.float8_e4m3fn
    assert e4.float().tolist() == [0.3125, 448.0, -448.0, 448.0, 0.0, 448.0, -448.0]
    e5 = ops.to_kv_cache(x, torch.float8_e5m2)
    assert e5.float().tolist() == [0.3125, 512.0, -1024.0, 448.0, 0.0, 57344.0, -57344.0]
    assert torch.isinf(torch.tensor([70000.0]).to(torch.float8_e5m2).float()).all()
    assert ops.to_kv_cache(x.bfloat16(), torch.bfloat16).equal(x.bfloat16())  # 16-bit: as is
    assert ops.kv_max(torch.float8_e4m3fn) == 448.0 and ops.kv_max(torch.bfloat16) == 0.0
    # the decode store into FP8 pools: k after norm + RoPE and v, rounded by torch's cast
    # where they are in range, saturated where they are not
    torch.manual_seed(1)
    weight, cos, sin = torch.rand(8), torch.rand(3, 4).repeat(1, 2), torch.rand(3, 4).repeat(1, 2)
    qkv, slots = torch.randn(3, 4 * 8) * 4, torch.tensor([5, 0, 2])
    qkv[1, 24] = 1000.0  # a v past e4m3's range
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    ops.qkv_norm_rope_store_ref(qkv, 2, 1, weight, weight, 1e-6, cos, sin, k_cache, v_cache,
                                slots)
    k = ops.norm_rope_ref(qkv[:, 16:24].view(3, 1, 8), weight, 1e-6, cos, sin)
    assert k_cache.view(8, 1, 8)[slots].float().equal(k.to(torch.float8_e4m3fn).float())
    v = qkv[:, 24:].view(3, 1, 8).clone()
    v[1, 0, 0] = 448.0
    assert v_cache.view(8, 1, 8)[slots].float().equal(v.to(torch.float8_e4m3fn).float())


def test_fp8_kv_pools_store_values_over_their_scale() -> None:
    """A checkpoint's k_scale / v_scale: the pool holds x / scale (times the float32
    reciprocal), rounded and saturated as at scale 1. By hand, e4m3, scale 0.5: 0.3 -> 0.6 =
    0.5 x 1.2 -> 0.5 x (1 + 2/8) = 0.625; 500 -> 1000, past 448: saturates; at scale 4:
    500 -> 125 = 64 x 1.953 -> 64 x (1 + 8/8) = 128. 16-bit pools ignore the scale."""
    x = torch.tensor([0.3, 500.0, -500.0])
    two = torch.tensor(2.0)
    assert ops.to_kv_cache(x, torch.float8_e4m3fn, two).float().tolist() == [0.625, 448.0,
                                                                             -448.0]
    assert ops.to_kv_cache(x, torch.float8_e4m3fn, torch.tensor(0.25)).float().tolist()[1] == 128
    assert ops.to_kv_cache(x.bfloat16(), torch.bfloat16, two).equal(x.bfloat16())
    scale = torch.empty(4)
    ops.fill_kv_scale(scale, 0.3, 7.0)
    assert scale.tolist() == torch.tensor([0.3, 7.0, 1 / 0.3, 1 / 7.0]).tolist()
    assert ops.unit_kv_scale(torch.device("cpu")).tolist() == [1.0] * 4
    # the decode store: k after norm + RoPE times 1/k_scale, v times 1/v_scale
    torch.manual_seed(2)
    weight, cos, sin = torch.rand(8), torch.rand(3, 4).repeat(1, 2), torch.rand(3, 4).repeat(1, 2)
    qkv, slots = torch.randn(3, 4 * 8) * 4, torch.tensor([5, 0, 2])
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    ops.qkv_norm_rope_store_ref(qkv, 2, 1, weight, weight, 1e-6, cos, sin, k_cache, v_cache,
                                slots, scale)
    k = ops.norm_rope_ref(qkv[:, 16:24].view(3, 1, 8), weight, 1e-6, cos, sin)
    inv_k, inv_v = (1 / torch.tensor([0.3, 7.0])).unbind()
    assert k_cache.view(8, 1, 8)[slots].float().equal((k * inv_k).to(k_cache.dtype).float())
    v = qkv[:, 24:].view(3, 1, 8)
    assert v_cache.view(8, 1, 8)[slots].float().equal((v * inv_v).to(v_cache.dtype).float())


_KERNELS = r"""
import torch
from cpmoe import ops
assert ops.use_triton(torch.zeros(1)), "interpreter not active"
torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    h = torch.randn(9, 2 * 40).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(h).float(), ops.silu_and_mul_ref(h).float(),
                               rtol=tol, atol=tol)
    y, idx = torch.randn(20, 48).to(dtype), torch.randint(0, 20, (6, 3))
    w = torch.rand(6, 3).to(dtype)
    torch.testing.assert_close(ops.weighted_row_sum(y, idx, w).float(),
                               ops.weighted_row_sum_ref(y, idx, w).float(), rtol=tol, atol=tol)
    # zero-weight slots (other EP ranks' experts) are not read: a NaN row there is ignored
    idx = torch.cat([torch.arange(6)[:, None], torch.randint(6, 20, (6, 2))], dim=1)
    y_nan = y.clone()
    y_nan[:6] = float("nan")  # read only by slot 0
    w0 = w.clone()
    w0[:, 0] = 0
    y_zero = torch.where(torch.isnan(y_nan), 0, y_nan)
    torch.testing.assert_close(ops.weighted_row_sum(y_nan, idx, w0).float(),
                               ops.weighted_row_sum_ref(y_zero, idx, w0).float(), rtol=tol,
                               atol=tol)
    for heads, weight in ((3, torch.rand(16).to(dtype)), (4, None)):
        x = torch.randn(5, heads, 16).to(dtype)
        cos, sin = torch.rand(5, 8).repeat(1, 2).to(dtype), torch.rand(5, 8).repeat(1, 2).to(dtype)
        torch.testing.assert_close(ops.norm_rope(x, weight, 1e-6, cos, sin).float(),
                                   ops.norm_rope_ref(x, weight, 1e-6, cos, sin).float(),
                                   rtol=tol, atol=tol)
    # decode: q/k norm + RoPE over the fused QKV rows, k and v stored at their cache slots
    for weight in (torch.rand(16).to(dtype), None):
        qkv = torch.randn(5, (4 + 2 * 2) * 16 + 3).to(dtype)[:, :128]  # strided rows
        cos, sin = torch.rand(5, 8).repeat(1, 2).to(dtype), torch.rand(5, 8).repeat(1, 2).to(dtype)
        slots = torch.tensor([9, 0, 14, 3, 7])
        caches = [torch.full((4, 4, 2, 16), float("nan")).to(dtype) for _ in range(4)]
        q = ops.qkv_norm_rope_store(qkv, 4, 2, weight, weight, 1e-6, cos, sin, *caches[:2],
                                    slots)
        ref = ops.qkv_norm_rope_store_ref(qkv, 4, 2, weight, weight, 1e-6, cos, sin,
                                          *caches[2:], slots)
        torch.testing.assert_close(q.float(), ref.float(), rtol=tol, atol=tol)
        for got, want in zip(caches[:2], caches[2:]):  # written slots equal, others untouched
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol,
                                       equal_nan=True)
    # FP8 pools (--kv-cache-dtype): the same stores, rounded to FP8 and saturated. The
    # interpreter (Triton 3.9) casts to FP8 toward zero at times where the GPU rounds to
    # nearest, and where rounding up reaches the next power of two it gives half of it (31
    # -> 16 in e4m3); the GPU test checks bits. Here: most values equal the ref's, each within
    # one FP8 step of it or where the ref holds a power of two
    qkv = torch.randn(5, 128, generator=torch.Generator().manual_seed(8)).to(dtype) * 30
    qkv[2, 4 * 16 + 2 * 16 + 5] = 1e4  # a v past e4m3's largest finite value (448)
    for fmt, step in ((torch.float8_e4m3fn, 2.0 ** -3), (torch.float8_e5m2, 2.0 ** -2)):
        caches = [torch.full((4, 4, 2, 16), float("nan")).to(fmt) for _ in range(4)]
        ops.qkv_norm_rope_store(qkv, 4, 2, None, None, 1e-6, cos, sin, *caches[:2], slots)
        ops.qkv_norm_rope_store_ref(qkv, 4, 2, None, None, 1e-6, cos, sin, *caches[2:], slots)
        for got, want in zip(caches[:2], caches[2:]):
            got, want = got.float(), want.float()
            assert torch.isnan(got).equal(torch.isnan(want))  # other slots untouched
            g, w = got.view(-1, 2, 16)[slots], want.view(-1, 2, 16)[slots]
            near = (g - w).abs() <= step * torch.maximum(g.abs(), w.abs()) + 2.0 ** -16
            power = w.abs() == 2.0 ** torch.log2(w.abs()).round()
            assert (near | power).all(), (fmt, (g - w).abs().max())
            assert (g == w).float().mean() > 0.9
        if fmt == torch.float8_e4m3fn:  # saturated, not NaN
            assert caches[1].float().view(-1, 2, 16)[14, 0, 5] == 448.0
    # with a layer's K/V scales (k_scale 0.05, v_scale 40: the v past 448 fits, 1e4 / 40)
    scale = torch.empty(4)
    ops.fill_kv_scale(scale, 0.05, 40.0)
    caches = [torch.full((4, 4, 2, 16), float("nan")).to(torch.float8_e4m3fn) for _ in range(4)]
    ops.qkv_norm_rope_store(qkv, 4, 2, None, None, 1e-6, cos, sin, *caches[:2], slots, scale)
    ops.qkv_norm_rope_store_ref(qkv, 4, 2, None, None, 1e-6, cos, sin, *caches[2:], slots,
                                scale)
    for got, want in zip(caches[:2], caches[2:]):
        g, w = got.float().view(-1, 2, 16)[slots], want.float().view(-1, 2, 16)[slots]
        near = (g - w).abs() <= 2.0 ** -3 * torch.maximum(g.abs(), w.abs()) + 2.0 ** -16
        power = w.abs() == 2.0 ** torch.log2(w.abs()).round()
        assert (near | power).all() and (g == w).float().mean() > 0.9
    assert caches[1].float().view(-1, 2, 16)[14, 0, 5] == 256.0  # 1e4 / 40 = 250 -> 256
    # residual add + RMSNorm: the sum is returned too, rounded like the separate add
    x, r, w = torch.randn(6, 40).to(dtype), torch.randn(6, 40).to(dtype), torch.rand(40).to(dtype)
    (out, s), (ref_out, ref_s) = ops.add_rms_norm(x, r, w, 1e-6), ops.add_rms_norm_ref(x, r, w, 1e-6)
    # (the interpreter rounds float32 -> bf16 by truncation: one bf16 ulp apart there)
    assert torch.equal(s, ref_s) if dtype == torch.float32 else torch.allclose(
        s.float(), ref_s.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    # partial attention as cuDNN returns it ([1, H, T, D] over a [T, H, D] buffer, lse
    # [1, H, T]), merged into a slice of a larger output
    o1, o2 = (torch.randn(7, 3, 16).to(dtype).transpose(0, 1)[None] for _ in range(2))
    l1, l2 = torch.randn(1, 3, 7), torch.randn(1, 3, 7)
    l2[0, 1, 2] = float("-inf")
    out = torch.zeros(10, 3, 16, dtype=dtype)
    ops.merge_two_attention(o1[0].transpose(0, 1), l1[0].T, o2[0].transpose(0, 1), l2[0].T,
                            out[2:9])
    want = ops.merge_partials(torch.stack([o1[0], o2[0]]).transpose(1, 2),
                              torch.stack([l1[0].T, l2[0].T]))
    torch.testing.assert_close(out[2:9].float(), want.float(), rtol=tol, atol=tol)
    assert not out[:2].any() and not out[9:].any()
    # router: softmax + top-k (+ renormalise), E not a power of two, ties to the lower id
    logits = torch.randn(37, 20).to(dtype)
    logits[3, 5] = logits[3, 11] = logits[3].max() + 1  # a tie for the top slot
    for k, renorm in ((4, True), (1, False), (20, True)):
        ids, w = ops.softmax_topk(logits, k, renorm, dtype)
        ref_ids, ref_w = ops.softmax_topk_ref(logits, k, renorm, dtype)
        probs = torch.softmax(logits.float(), dim=-1)
        want_ids = torch.sort(-probs, dim=-1, stable=True).indices[:, :k]
        assert torch.equal(ids, want_ids), (ids, want_ids)
        assert ids.dtype == torch.int64 and w.dtype == dtype and ids[3, 0] == 5
        torch.testing.assert_close(w.float(), ref_w.float(), rtol=tol, atol=tol)
        assert torch.equal(torch.sort(ids).values, torch.sort(ref_ids).values) or k == 1
print("kernels ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernels_match_references_in_the_interpreter() -> None:
    out = run_interpreted(_KERNELS, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernels ok" in out.stdout


_V4_KERNELS = r"""
import torch
from cpmoe import ops

g = torch.Generator().manual_seed(0)
U = 2.0 ** -24
for dtype in (torch.float32, torch.bfloat16):
    # clamped SwiGLU on the two halves of packed rows (row stride 2I), values past the limit
    h = (torch.randn(7, 2 * 300, generator=g) * 6).to(dtype)
    gate, up = h.chunk(2, dim=-1)
    gf, uf = gate.float().clamp(max=5.0), up.float().clamp(-5.0, 5.0)
    want = gf * torch.sigmoid(gf) * uf
    got = ops.activation.clamped_swiglu_triton(gate, up, 5.0)
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    assert got.dtype == dtype and got.is_contiguous()
    assert ((got.float() - want).abs() <= tol * (want.abs() + 1e-3)).all(), dtype
    # RMSNorm with a float32 weight, rows of a 3-d tensor, N not a power of two
    x = (torch.randn(3, 5, 200, generator=g) * 4).to(dtype)
    w = torch.rand(200, generator=g) + 0.5
    xd = x.double()
    want = w.double() * xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    got = ops.rms_norm_fp32_weight(x, w, 1e-6)
    tol = (200 / 2 + 8) * U if dtype == torch.float32 else 2.0 ** -7
    assert got.dtype == dtype and got.shape == x.shape
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-30).all(), dtype
print("v4 ops ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_v4_swiglu_and_fp32_weight_norm_match_formulas_in_the_interpreter() -> None:
    """Tolerance: float32, the SiLU product in fp32 (a few u) and the norm's sum of N squares
    in fp32 (N/2 u on the scale, plus a few u), against float32/float64 formulas written
    here; bf16 rounds once, one ulp (2^-7 relative: the interpreter truncates)."""
    out = run_interpreted(_V4_KERNELS, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "v4 ops ok" in out.stdout
