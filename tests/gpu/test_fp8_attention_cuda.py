"""FP8 prefill attention through cuDNN (`cpmoe.cp.fp8_attention`) against float32 attention
(skipped without a GPU or without nvidia-cudnn-frontend; run on the GPU machine:
`python3 -m pytest tests/gpu/test_fp8_attention_cuda.py -q -s`).

Tolerance, from e4m3 (3 mantissa bits: a value rounds to within 2^-4 of itself): the error
is what quantizing q, k, v, the probabilities (scale 448) and o to e4m3 makes, which the
test emulates in float32 on the same inputs (`emulate`: per-tensor scales as the module sets
them, P quantized after the row max as flash-style kernels do); the emulation's relative
Frobenius error against exact float32 attention is 5-6% on these N(0, 1) inputs (12% with
three times sharper scores), and cuDNN must stay within 1.5x it (its accumulation order,
online rescaling and rounding of P differ; a wrong mask, head mapping or scale is off by
tens of percent). bf16 inputs, as the engine gives them.

Cases: square causal runs (no padding, power-of-two lengths; 1,000 rows padded to the
1,024 bucket), full attention of 300 queries against 1,000 keys (both padded) with its
log-sum-exp against float32's, GQA 32/4 heads of 128 (Qwen3-30B-A3B); and
`prefill_attention(fp8=True)` on the two runs a zigzag CP split gives a rank (the second
merged from its own keys and the keys before it by log-sum-exp), against float32; its O
kept in e4m3 for an FP8 o_proj (one run and two), against float32 through that GEMM; an extend
chunk after a prefix held in e4m3 pools at a layer's K/V scales (`chunk_attention_with_lse`
and `prefix_partial` with fp8); q in e4m3 from the norm + RoPE kernel
(`ops.norm_rope_fp8`, Qwen3's path). The graph cache: a second call of a shape builds
nothing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.cp import fp8_attention as fa
from cpmoe.cp.attention import prefill_attention

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                       reason="needs nvidia-cudnn-frontend"),
    pytest.mark.usefixtures("exact_fp32_matmul"),
]

H, G, D = 32, 4, 128
SCALE = D ** -0.5


def _q8(x: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to e4m3 with the module's per-tensor scale (or s), back in float32."""
    s = fa.E4M3_MAX / x.abs().max() if s is None else s
    return (x.float() * s).to(torch.float8_e4m3fn).float() / s


def _scores(q, k, causal):
    n, m = q.shape[0], k.shape[0]  # causal: bottom-right aligned (a run ending at key m)
    s = torch.einsum("nhd,mhd->hnm", q.float(), k.float().repeat_interleave(H // G, 1))
    s = s * SCALE
    if causal:
        i, j = torch.arange(n, device=q.device)[:, None], torch.arange(m, device=q.device)
        s = s.masked_fill(j[None] > m - n + i, float("-inf"))
    return s


def exact(q, k, v, causal):
    p = _scores(q, k, causal).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", p, v.float().repeat_interleave(H // G, 1))


def emulate(q, k, v, causal, q_scale=None, k_scale=None):
    s = _scores(_q8(q, q_scale), _q8(k, k_scale), causal)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p8 = (p * fa.E4M3_MAX).to(torch.float8_e4m3fn).float() / fa.E4M3_MAX
    o = torch.einsum("hnm,mhd->nhd", p8, _q8(v).repeat_interleave(H // G, 1))
    return _q8(o / p.sum(-1).transpose(0, 1)[..., None])


def _rope(pos):
    """Qwen3's rotary tables (theta 1e6, rotate-half layout) at positions pos, in bf16."""
    inv = 1e6 ** (-torch.arange(0, D, 2, device="cuda").float() / D)
    angle = pos[:, None].float() * inv[None, :]
    return angle.cos().repeat(1, 2).bfloat16(), angle.sin().repeat(1, 2).bfloat16()


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("n, m, causal, sharp", [
    (1024, 1024, True, 1.0), (4096, 4096, True, 1.0), (1000, 1000, True, 1.0),
    (512, 768, False, 1.0), (1024, 1024, True, 3.0)])
def test_fp8_attention_within_its_quantization_error(n, m, causal, sharp):
    g = torch.Generator(device="cuda").manual_seed(n + m)
    q = (sharp * torch.randn(n, H, D, device="cuda", generator=g)).bfloat16()
    k = (sharp * torch.randn(m, G, D, device="cuda", generator=g)).bfloat16()
    v = torch.randn(m, G, D, device="cuda", generator=g).bfloat16()
    got = fa.fp8_attention(q, k, v, SCALE, causal)[0]
    want, emul = exact(q, k, v, causal), emulate(q, k, v, causal)
    err, bound = _rel(got, want), 1.5 * _rel(emul, want)
    print(f"n={n} m={m} causal={causal} sharp={sharp}: fp8 {err:.4f}, emulated "
          f"{bound / 1.5:.4f}")
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert _rel(emul, want) < (0.07 if sharp == 1.0 else 0.15)
    assert err <= bound, (err, bound)
    built = len(fa._GRAPHS)
    fa.fp8_attention(q, k, v, SCALE, causal)
    assert len(fa._GRAPHS) == built  # cached


def test_fp8_attention_lse_is_the_rows_log_sum_exp():
    """Full attention of 300 queries over 1,000 keys: the log-sum-exp of each row's scaled
    scores (natural log) within the FP8 score error (q and k each within 2^-4 relative:
    |ds| <= 2 * 2^-4 * scale * |q| |k| at most, and the lse moves no more than its largest
    score), and a causal call with unequal lengths refused in one line."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(300, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(1000, G, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(1000, G, D, device="cuda", generator=g).bfloat16()
    o, lse = fa.fp8_attention(q, k, v, SCALE, False, lse=True)
    want = torch.logsumexp(_scores(q, k, False), dim=-1).t()  # [n, H]
    bound = 2 * 2.0 ** -4 * SCALE * q.float().norm(dim=-1).max() * k.float().norm(dim=-1).max()
    assert lse.shape == (300, H) and lse.dtype == torch.float32
    assert float((lse - want).abs().max()) <= float(bound)
    assert _rel(o, exact(q, k, v, False)) <= 1.5 * _rel(emulate(q, k, v, False),
                                                         exact(q, k, v, False))
    with pytest.raises(ValueError, match="as many keys as queries"):
        fa.fp8_attention(q, k, v, SCALE, True)


def test_prefill_attention_fp8_runs_match_the_16_bit_path():
    """One 4,096-token sequence, a rank's two zigzag runs (positions 0..1023 and
    3072..4095): fp8=True within the FP8 error of the 16-bit path, per run (the runner
    would keep runs this short 16-bit, `fp8_worth`; called with fp8=True they go FP8)."""
    from cpmoe.cp.attention import fp8_runs_apply, fp8_worth
    g = torch.Generator(device="cuda").manual_seed(5)
    L = 4096
    k = torch.randn(L, G, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(L, G, D, device="cuda", generator=g).bfloat16()
    pos = torch.cat([torch.arange(0, 1024), torch.arange(3072, 4096)]).cuda()
    q = torch.randn(pos.numel(), H, D, device="cuda", generator=g).bfloat16()
    seq = torch.zeros_like(pos)
    runs = [(0, 1024, 0, 0), (1024, 2048, 0, 3072)]
    assert fp8_runs_apply(q, runs, True) and not fp8_worth(runs, [0])
    want = prefill_attention(q, pos, seq, k, v, [0, L], SCALE, runs)
    got = prefill_attention(q, pos, seq, k, v, [0, L], SCALE, runs, fp8=True)
    for (r0, r1, _, p0) in runs:
        n = r1 - r0
        ref = exact(q[r0:r1], k[:p0 + n], v[:p0 + n], True)
        # the emulation of the merged run: its own keys and the keys before it quantized
        # as the two calls quantize them
        emul = emulate(q[r0:r1], k[:p0 + n], v[:p0 + n], True)
        assert _rel(want[r0:r1], ref) < 0.01  # the 16-bit path, for scale
        print(f"run at {p0}: fp8 {_rel(got[r0:r1], ref):.4f}, emulated {_rel(emul, ref):.4f}")
        assert _rel(got[r0:r1], ref) <= 1.5 * _rel(emul, ref), (r0, _rel(got[r0:r1], ref))


def test_prefill_attention_takes_q_in_e4m3_from_norm_rope_fp8():
    """The model's FP8 prefill path for Qwen3's q (`ops.norm_rope_fp8`, then
    `prefill_attention` with its descale): the codes are the reference arithmetic's
    (`norm_rope_fp8_ref`; where the two float32 values round apart, one e4m3 step), and
    attention from them, on a rank's two zigzag runs of a 4,096-token sequence, is within
    1.5x the emulated FP8 error of exact attention over the 16-bit normed q, the emulation
    quantizing q at the same weight-bound scale; with an FP8 o_proj after it (one run at
    the start), O is offered in e4m3 as with a 16-bit q. The K/V store kernel's e4m3 q (a
    served chunk's, `ops.qkv_norm_rope_store_fp8`) is the same codes, its pools the 16-bit
    q store's."""
    from cpmoe import ops
    from cpmoe.ops.fp8 import offered
    g = torch.Generator(device="cuda").manual_seed(13)
    L, n = 4096, 1024
    k = torch.randn(L, G, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(L, G, D, device="cuda", generator=g).bfloat16()
    pos = torch.cat([torch.arange(0, n), torch.arange(L - n, L)]).cuda()
    rows = (3 * torch.randn(2 * n, H + 8, D, device="cuda", generator=g)).bfloat16()
    raw = rows[:, :H]  # q's columns of the QKV rows: strided
    w = (0.5 + 1.5 * torch.rand(D, device="cuda", generator=g)).bfloat16()
    cos, sin = _rope(pos)
    q8, dq = ops.norm_rope_fp8(raw, w, 1e-6, cos, sin)
    want8, want_dq = ops.norm_rope_fp8_ref(raw, w, 1e-6, cos, sin)
    assert float(dq) == float(want_dq)
    gf, wf = q8.float(), want8.float()
    assert (gf != wf).float().mean() < 0.01
    assert ((gf - wf).abs() <= 2.0 ** -3 * wf.abs() + 2.0 ** -9).all()
    # the served chunk's store kernel writes the same q codes, and the same e4m3 pools as
    # with a 16-bit q
    qkv = torch.cat([raw.reshape(2 * n, H * D), k[:2 * n].reshape(2 * n, G * D),
                     v[:2 * n].reshape(2 * n, G * D)], 1)
    slots = torch.randperm(4096, device="cuda")[:2 * n]
    kv_scale = torch.tensor([0.02, 0.01, 50.0, 100.0], device="cuda")
    pools = [torch.zeros(256, 16, G, D, dtype=torch.float8_e4m3fn, device="cuda")
             for _ in range(4)]
    s8, sd = ops.qkv_norm_rope_store_fp8(qkv, H, G, w, w, 1e-6, cos, sin, *pools[:2], slots,
                                         kv_scale)
    ops.qkv_norm_rope_store(qkv, H, G, w, w, 1e-6, cos, sin, *pools[2:], slots, kv_scale)
    assert s8.view(torch.uint8).equal(q8.view(torch.uint8)) and sd.equal(dq)
    assert all(a.view(torch.uint8).equal(b.view(torch.uint8))
               for a, b in zip(pools[:2], pools[2:]))
    q16 = ops.norm_rope(raw, w, 1e-6, cos, sin)
    seq = torch.zeros_like(pos)
    runs = [(0, n, 0, 0), (n, 2 * n, 0, L - n)]
    got = prefill_attention(q8, pos, seq, k, v, [0, L], SCALE, runs, fp8=True, q_descale=dq)
    amax_path = prefill_attention(q16, pos, seq, k, v, [0, L], SCALE, runs, fp8=True)
    assert got.dtype == torch.bfloat16 and got.shape == q16.shape
    for (r0, r1, _, p0) in runs:
        ref = exact(q16[r0:r1], k[:p0 + n], v[:p0 + n], True)
        emul = emulate(q16[r0:r1], k[:p0 + n], v[:p0 + n], True, q_scale=1 / dq)
        err = _rel(got[r0:r1], ref)
        print(f"run at {p0}: q from norm_rope_fp8 {err:.4f}, q quantized at its amax "
              f"{_rel(amax_path[r0:r1], ref):.4f}, emulated {_rel(emul, ref):.4f}")
        assert err <= 1.5 * _rel(emul, ref), (p0, err)
    o = prefill_attention(q8[:n], pos[:n], seq[:n], k[:n], v[:n], [0, n], SCALE, runs[:1],
                          fp8=True, o_quant_group=128, q_descale=dq)
    codes, scales = offered(o.view(n, H * D), 128)
    assert o.dtype == torch.bfloat16 and codes.dtype == torch.float8_e4m3fn
    o16 = prefill_attention(q8[:n], pos[:n], seq[:n], k[:n], v[:n], [0, n], SCALE, runs[:1],
                            fp8=True, q_descale=dq)
    # the same codes: dequantized once, or offered with their descale in every group
    assert torch.equal((codes.float() * scales[:, :1]).bfloat16(), o16.view(n, H * D))


def test_prefill_attention_takes_k_in_e4m3_from_norm_rope_fp8():
    """Qwen3's k as its q (the model at CP 1): both from `ops.norm_rope_fp8`, each at its
    norm weight's bound, so FP8 attention quantizes neither. On a rank's two zigzag runs of
    a 4,096-token sequence (the second attends the keys before it in full) within 1.5x the
    emulated FP8 error of exact attention over the 16-bit normed q and k, the emulation
    quantizing both at those scales; and O offered to an FP8 o_proj in e4m3 equals, once
    dequantized, the 16-bit O of the same codes."""
    from cpmoe import ops
    from cpmoe.ops.fp8 import offered
    g = torch.Generator(device="cuda").manual_seed(17)
    L, n = 4096, 1024
    pos_all = torch.arange(L, device="cuda")
    rows = (3 * torch.randn(L, H + G, D, device="cuda", generator=g)).bfloat16()
    v = torch.randn(L, G, D, device="cuda", generator=g).bfloat16()
    wq = (0.5 + 1.5 * torch.rand(D, device="cuda", generator=g)).bfloat16()
    wk = (0.2 + 3.0 * torch.rand(D, device="cuda", generator=g)).bfloat16()
    cos, sin = _rope(pos_all)
    k8, dk = ops.norm_rope_fp8(rows[:, H:], wk, 1e-6, cos, sin)  # k's columns: strided
    k16 = ops.norm_rope(rows[:, H:], wk, 1e-6, cos, sin)
    assert float(dk) == float(ops.norm_rope_fp8_ref(rows[:, H:], wk, 1e-6, cos, sin)[1])
    pos = torch.cat([torch.arange(0, n), torch.arange(L - n, L)]).cuda()
    q8, dq = ops.norm_rope_fp8(rows[pos, :H], wq, 1e-6, cos[pos], sin[pos])
    q16 = ops.norm_rope(rows[pos, :H], wq, 1e-6, cos[pos], sin[pos])
    seq = torch.zeros_like(pos)
    runs = [(0, n, 0, 0), (n, 2 * n, 0, L - n)]
    got = prefill_attention(q8, pos, seq, k8, v, [0, L], SCALE, runs, fp8=True,
                            q_descale=dq, k_descale=dk)
    amax_k = prefill_attention(q8, pos, seq, k16, v, [0, L], SCALE, runs, fp8=True,
                               q_descale=dq)
    assert got.dtype == torch.bfloat16 and got.shape == q16.shape
    for (r0, r1, _, p0) in runs:
        ref = exact(q16[r0:r1], k16[:p0 + n], v[:p0 + n], True)
        emul = emulate(q16[r0:r1], k16[:p0 + n], v[:p0 + n], True, q_scale=1 / dq,
                       k_scale=1 / dk)
        err = _rel(got[r0:r1], ref)
        print(f"run at {p0}: k from norm_rope_fp8 {err:.4f}, k quantized at its amax "
              f"{_rel(amax_k[r0:r1], ref):.4f}, emulated {_rel(emul, ref):.4f}")
        assert err <= 1.5 * _rel(emul, ref), (p0, err)
    o = prefill_attention(q8[:n], pos[:n], seq[:n], k8[:n], v[:n], [0, n], SCALE, runs[:1],
                          fp8=True, o_quant_group=128, q_descale=dq, k_descale=dk)
    codes, scales = offered(o.view(n, H * D), 128)
    o16 = prefill_attention(q8[:n], pos[:n], seq[:n], k8[:n], v[:n], [0, n], SCALE, runs[:1],
                            fp8=True, q_descale=dq, k_descale=dk)
    assert torch.equal((codes.float() * scales[:, :1]).bfloat16(), o16.view(n, H * D))


@pytest.mark.parametrize("lengths", [(1000,), (1024, 1000)])
def test_fp8_prefill_o_reaches_the_fp8_o_proj_in_e4m3(lengths):
    """`prefill_attention(fp8=True, o_quant_group=128)`: O stays e4m3 and the FP8 o_proj
    (`fp8_linear`, block-scaled 128 x 128) reads the codes through the offer; one run (1,000
    rows: cuDNN's buffer offered, scaled_mm's 16-row padding taken from the offer) and two
    runs (their codes and descales gathered in one offer). Against float32 attention times
    the dequantized weight: within 1.5x the emulated FP8 error (as above), and no worse than
    the path that dequantizes O to bf16 and quantizes it again per 1 x 128 group (a second
    e4m3 rounding, up to 2^-4 of each value, that the offer saves)."""
    from cpmoe.ops.fp8 import offered, quantize_block_fp8, dequantize
    from cpmoe.ops.fp8_gemm import fp8_linear
    g = torch.Generator(device="cuda").manual_seed(11)
    T = sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    k = torch.randn(T, G, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(T, G, D, device="cuda", generator=g).bfloat16()
    q = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)]).cuda()
    runs = [(cu[s], cu[s + 1], s, 0) for s in range(len(lengths))]
    wq, ws = quantize_block_fp8(0.02 * torch.randn(2048, H * D, device="cuda", generator=g))
    w = dequantize(wq, ws, (128, 128))
    o = prefill_attention(q, pos, seq, k, v, cu, SCALE, runs, fp8=True, o_quant_group=128)
    codes, scales = offered(o.view(T, H * D), 128)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (T, H * D)
    assert scales.shape == (T, H * D // 128) and scales.stride() == (1, T)
    got = fp8_linear(o.view(T, H * D), wq, ws, (128, 128)).float()
    o16 = prefill_attention(q, pos, seq, k, v, cu, SCALE, runs, fp8=True)  # O dequantized
    widened = fp8_linear(o16.view(T, H * D), wq, ws, (128, 128)).float()
    ref = torch.cat([exact(q[a:b], k[a:b], v[a:b], True) for a, b, _, _ in runs])
    emul = torch.cat([emulate(q[a:b], k[a:b], v[a:b], True) for a, b, _, _ in runs])
    want = ref.reshape(T, H * D) @ w.t()
    bound = 1.5 * _rel(emul.reshape(T, H * D) @ w.t(), want)
    err, err16 = _rel(got, want), _rel(widened, want)
    print(f"runs {lengths}: o_proj of e4m3 O {err:.4f}, of O widened and requantized "
          f"{err16:.4f}, emulated {bound / 1.5:.4f}")
    assert err <= bound and err <= err16, (err, err16, bound)


def test_extend_after_a_cached_prefix_in_fp8_within_its_quantization_error():
    """A 1,024-token chunk after 3,000 cached tokens held in e4m3 pools at a layer's K/V
    scales (prefix codes read as they are, the scales as descales): the chunk's own keys
    (`chunk_attention_with_lse`, fp8) and the prefix (`prefix_partial`, fp8), merged, within
    1.5x the emulated FP8 error of exact attention over all 4,000 keys, as above."""
    from cpmoe.cp import attention as att
    from cpmoe.ops import fill_kv_scale, merge_two_attention
    g = torch.Generator(device="cuda").manual_seed(7)
    P, n = 3000, 1024
    k = torch.randn(P + n, G, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(P + n, G, D, device="cuda", generator=g).bfloat16()
    q = torch.randn(n, H, D, device="cuda", generator=g).bfloat16()
    kv_scale = torch.empty(4, device="cuda")
    fill_kv_scale(kv_scale, float(k[:P].float().abs().max()) / 448,
                  float(v[:P].float().abs().max()) / 448)
    slots = torch.randperm(4096, device="cuda")[:P]  # the prefix's slots, shuffled pages
    pool_k = torch.zeros(256, 16, G, D, device="cuda", dtype=torch.float8_e4m3fn)
    pool_v = torch.zeros_like(pool_k)
    pool_k.view(-1, G, D)[slots] = (k[:P].float() * kv_scale[2]).to(torch.float8_e4m3fn)
    pool_v.view(-1, G, D)[slots] = (v[:P].float() * kv_scale[3]).to(torch.float8_e4m3fn)
    pos, seq = torch.arange(n, device="cuda"), torch.zeros(n, dtype=torch.int64, device="cuda")
    runs = [(0, n, 0, 0)]
    assert att.fp8_runs_apply(q, runs, True)
    o1, l1 = att.chunk_attention_with_lse(q, pos, seq, k[P:], v[P:], [0, n], SCALE, None,
                                          runs, True)
    prefix = att.PackedPrefix.build([torch.arange(n)], [slots.cpu()], torch.device("cuda"))
    o2, l2 = att.prefix_partial(q, prefix, pool_k, pool_v, SCALE, kv_scale, fp8=True)
    got = torch.empty_like(q)
    merge_two_attention(o1, l1, o2, l2, got)
    ref = exact(q, k, v, True)  # bottom-right causal: the chunk ends at key P + n
    emul = emulate(q, k, v, True)
    print(f"extend after {P}: fp8 {_rel(got, ref):.4f}, emulated {_rel(emul, ref):.4f}")
    assert _rel(got, ref) <= 1.5 * _rel(emul, ref)


def test_quantize_kernels_equal_float32_arithmetic_bit_for_bit():
    """`quantize`'s two kernels on the GPU: the codes are x * (448 / max |x|) computed in
    float32 and rounded once to e4m3 (nearest even, as torch's cast), bit for bit, the
    bucket's padding zero codes, the descale max |x| / 448; and `dequantize` writes
    codes * descale rounded to bf16 into the slice it is given."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (3 * torch.randn(1000, H, D, device="cuda", generator=g)).bfloat16()
    x[517, 3, 9] = -2 * x.float().abs().max()  # the largest magnitude negative
    got, descale = fa.quantize(x, 1024)
    amax = x.float().abs().max()
    want = (x.float() * (torch.tensor(fa.E4M3_MAX, device="cuda") / amax)).to(
        torch.float8_e4m3fn)
    assert got[:1000].view(torch.uint8).equal(want.view(torch.uint8))
    assert not got[1000:].view(torch.uint8).any()
    assert float(descale) == float(amax / fa.E4M3_MAX)
    out = torch.full((1200, H, D), 7.0, dtype=torch.bfloat16, device="cuda")
    fa.dequantize(got[:1000], descale, out[100:1100])
    assert torch.equal(out[100:1100], (got[:1000].float() * descale.view(())).bfloat16())
    assert (out[:100] == 7).all() and (out[1100:] == 7).all()
