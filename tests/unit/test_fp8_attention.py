"""What `--kv-cache-dtype fp8_e4m3` decides before any GPU work (the CUDA kernel itself:
tests/gpu/test_fp8_attention_cuda.py): when prefill attention runs in FP8, the one line a
machine without cuDNN's frontend gets, the graph buckets, the e4m3 q and k a Qwen3 prefill
without a cache hands its FP8 attention, and the device-side quantization:
its torch path on CPU, and its Triton kernels (the amax, the scale-and-cast with the
bucket's padding, on contiguous and on strided rows, O's dequantization, q's norm + RoPE in
e4m3 at its weight-bound scale, alone and in the K/V store kernel) in Triton's CPU
interpreter against the test's own float32 arithmetic (a subprocess: TRITON_INTERPRET is
read at import; skipped without Triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.cp import fp8_attention as fa
from cpmoe.engine.sizing import fp8_attention_applies, fp8_attention_refusal
from tests._interpreter import run_interpreted

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_fp8_attention_applies_to_e4m3_pools_of_16_bit_models_on_cuda_only():
    assert fp8_attention_applies("fp8_e4m3", CUDA, torch.bfloat16)
    assert fp8_attention_applies("fp8_e4m3", CUDA, torch.float16)
    assert not fp8_attention_applies("fp8_e4m3", CPU, torch.bfloat16)
    assert not fp8_attention_applies("fp8_e4m3", CUDA, torch.float32)
    assert not fp8_attention_applies("fp8_e5m2", CUDA, torch.bfloat16)
    assert not fp8_attention_applies("auto", CUDA, torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is not None,
                    reason="nvidia-cudnn-frontend is installed here")
def test_missing_cudnn_frontend_is_one_line_naming_the_package():
    line = fp8_attention_refusal("fp8_e4m3", CUDA, torch.bfloat16)
    assert line is not None and "\n" not in line
    assert "--kv-cache-dtype fp8_e4m3" in line and "nvidia-cudnn-frontend" in line
    assert "cpmoe[cuda]" in line
    assert fp8_attention_refusal("fp8_e4m3", CPU, torch.float32) is None
    assert fp8_attention_refusal("auto", CUDA, torch.bfloat16) is None


def test_graph_buckets_are_powers_of_two_from_128():
    assert [fa.bucket(n) for n in (1, 127, 128, 129, 1000, 16384, 16385)] == \
        [128, 128, 128, 256, 1024, 16384, 32768]


def test_quantize_keeps_the_largest_value_at_448_and_zeroes_the_padding():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(100, 4, 16, generator=g) * 7).bfloat16()
    x8, descale = fa.quantize(x, 128)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == (128, 4, 16)
    assert descale.shape == (1, 1, 1, 1) and descale.dtype == torch.float32
    back = x8[:100].float() * descale.view(())
    assert float(x8.float().abs().max()) == fa.E4M3_MAX
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative of each value, subnormals aside
    normal = x.float().abs() > descale.view(()) * 2.0 ** -6
    assert ((back - x.float()).abs() <= 2.0 ** -4 * x.float().abs() + 1e-6)[normal].all()
    assert (x8[100:].float() == 0).all()
    zero8, zero_descale = fa.quantize(torch.zeros(3, 2, 8, dtype=torch.bfloat16), 3)
    assert zero_descale.item() == pytest.approx(1.0 / fa.E4M3_MAX) and (zero8.float() == 0).all()


def _rope(T: int, D: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [T, D] of real angles, the two halves equal (rotate-half)."""
    angle = torch.rand(T, D // 2, generator=g) * 6.3
    return angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)


def test_norm_rope_fp8_scale_is_a_bound_the_weight_reaches():
    """`norm_rope_fp8`'s per-tensor scale, 448 / (max |w| sqrt(D)), bounds every normed,
    rotated value: a head whose energy sits in one input, at the largest weight, at angle
    0, reaches code 448 exactly; random heads at random angles never saturate; the codes
    times the descale are the float32 values within e4m3's 2^-4 (the test's own arithmetic,
    not the module's)."""
    from cpmoe import ops
    g = torch.Generator().manual_seed(1)
    T, heads, D = 64, 4, 16
    w = (torch.rand(D, generator=g) * 3).bfloat16()
    top = int(w.float().abs().argmax())
    cos, sin = _rope(T, D, g)
    cos[0], sin[0] = 1.0, 0.0  # position 0: no rotation
    x = torch.randn(T, heads, D, generator=g).bfloat16()
    x[0, 2] = 0
    x[0, 2, top] = -5.0  # all of head 2's energy at the largest weight
    codes, descale = ops.norm_rope_fp8_ref(x, w, 1e-6, cos, sin)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (T, heads, D)
    bound = w.float().abs().max() * D ** 0.5
    assert descale.shape == (1,) and float(descale) == pytest.approx(float(bound) / 448, 1e-6)
    assert float(codes[0, 2, top].float()) == -448.0
    assert int((codes.float().abs() == 448).sum()) == 1  # only the one-hot head saturates
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    y1, y2 = y[..., :D // 2], y[..., D // 2:]
    c, sn = cos[:, None, :D // 2], sin[:, None, :D // 2]
    want = torch.cat([y1 * c - y2 * sn, y2 * c + y1 * sn], -1)
    back = codes.float() * descale
    normal = want.abs() > float(descale) * 2.0 ** -6
    assert ((back - want).abs() <= 2.0 ** -4 * want.abs() + 1e-6)[normal].all()
    assert ((back - want).abs() <= float(descale) * 2.0 ** -10)[~normal].all()
    zero, zero_descale = ops.norm_rope_fp8_ref(x, torch.zeros(D).bfloat16(), 1e-6, cos, sin)
    assert float(zero_descale) == pytest.approx(1 / 448) and not zero.float().any()


def test_warm_up_builds_the_chunk_graphs_and_its_prefix_graphs(monkeypatch):
    """A server's warm-up (chunk 300, 1,000 K/V slots a rank): square causal graphs of every
    bucket up to the chunk's (512), the chunk's causal graph with its log-sum-exp (an extend)
    and its full-attention graphs against every key bucket up to 1,024 (the cached prefix);
    a second warm-up builds nothing."""
    calls = []

    def record(q, k, v, scale, causal, lse=False):
        calls.append((q.shape[0], k.shape[0], causal, lse))
        fa._GRAPHS[(q.device, q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2],
                    causal, lse, scale)] = None

    monkeypatch.setattr(fa, "fp8_attention", record)
    monkeypatch.setattr(fa, "_GRAPHS", {})
    cpu = torch.device("cpu")
    assert fa.warm_up(cpu, 4, 2, 16, 0.25, 300, 1000) == 8
    assert calls == [(128, 128, True, False), (256, 256, True, False),
                     (512, 512, True, False), (512, 512, True, True),
                     (512, 128, False, True), (512, 256, False, True),
                     (512, 512, False, True), (512, 1024, False, True)]
    assert fa.warm_up(cpu, 4, 2, 16, 0.25, 300, 1000) == 0


def test_qwen3_prefill_without_a_cache_hands_fp8_attention_q_and_k_in_e4m3(monkeypatch):
    """A prefill without a KV cache at CP 1, its attention in FP8 (as `cpmoe bench` runs it;
    the CUDA decision and cuDNN's call replaced by stand-ins): q and k reach
    `prefill_attention` in e4m3, each with the descale of its own norm weight's bound, max |w|
    sqrt(D) / 448, v in 16 bits; with FP8 attention off all three stay 16-bit, no descale."""
    import math

    from cpmoe.bench.spec import SHAPES
    from cpmoe.engine import runner as runner_mod
    from cpmoe.engine.runner import ModelRunner, Segment
    from cpmoe.models.qwen_moe import model as qwen
    from cpmoe.parallel.groups import ProcessGroups

    seen = []

    def attend(q, pos, seq, k, v, cu, scale, runs=None, packed=None, fp8=False,
               group=None, q_descale=None, k_descale=None):
        seen.append((q.dtype, k.dtype, v.dtype, q_descale, k_descale))
        return torch.zeros(q.shape, dtype=v.dtype)

    monkeypatch.setattr(qwen, "prefill_attention", attend)
    monkeypatch.setattr(qwen, "fp8_runs_apply", lambda q, runs, fp8: fp8 and bool(runs))
    monkeypatch.setattr(runner_mod, "fp8_worth", lambda runs, starts: True)
    r = ModelRunner.from_config(SHAPES["tiny"], ProcessGroups.single("cpu"), torch.bfloat16,
                                seed=5)
    layers = r.model.model.layers
    D = SHAPES["tiny"]["head_dim"]
    for layer in layers:  # norm weights of different bounds for q and k
        layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
        layer.self_attn.k_norm.weight.data.uniform_(0.2, 3.0)
    prompt = torch.randint(2, 500, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    for fp8 in (True, False):
        seen.clear()
        r.fp8_attention = fp8
        r.extend([Segment(0, prompt)])
        assert len(seen) == len(layers)
        for layer, (q_dt, k_dt, v_dt, dq, dk) in zip(layers, seen):
            if not fp8:
                assert (q_dt, k_dt, v_dt, dq, dk) == (torch.bfloat16,) * 3 + (None, None)
                continue
            assert (q_dt, k_dt, v_dt) == (torch.float8_e4m3fn,) * 2 + (torch.bfloat16,)
            for norm, descale in ((layer.self_attn.q_norm, dq), (layer.self_attn.k_norm, dk)):
                bound = float(norm.weight.float().abs().max()) * math.sqrt(D)
                assert float(descale) == pytest.approx(bound / 448, rel=1e-6)
            assert float(dk) != pytest.approx(float(dq), rel=1e-3)


def test_pool_codes_go_in_as_they_are_padded_with_zeros():
    """K/V codes read from an e4m3 pool: padded to the bucket with zero codes, values
    unchanged, their descale (a view of the layer's scales) shaped for the graph."""
    codes = (torch.randn(5, 2, 16) * 50).to(torch.float8_e4m3fn)
    scales = torch.tensor([0.3, 2.0, 1 / 0.3, 0.5])
    x, d = fa._as_fp8(codes, 128, scales[0:1])
    assert x.dtype == torch.float8_e4m3fn and x.shape == (128, 2, 16)
    assert x[:5].view(torch.uint8).equal(codes.view(torch.uint8))
    assert not x[5:].float().any() and d.shape == (1, 1, 1, 1) and float(d) == float(scales[0])


_KERNEL_CASES = r"""
import torch
from cpmoe.cp import fp8_attention as fa
from cpmoe.ops import launch
assert launch.use_triton(torch.zeros(1))  # the kernels run, not the torch path
g = torch.Generator().manual_seed(0)
E4M3 = torch.float8_e4m3fn

def want_codes(x, rows):
    # the test's own arithmetic: s = 448 / max |x| in float32, x * s rounded once to e4m3
    amax = x.float().abs().max()
    amax = amax if amax > 0 else torch.tensor(1.0)
    s = torch.tensor(448.0) / amax
    codes = torch.zeros(rows, *x.shape[1:], dtype=E4M3)
    codes[:x.shape[0]] = (x.float() * s).to(E4M3)
    return codes, amax / 448.0

# tiles of rows x columns (8,192 elements; columns 32, 256, 128, 16 here): rows within one
# tile, over several with a partial last one and padding rows after, an exact multiple, an
# all-zero input; bf16 and fp16
for n, heads, dim, rows, dtype, scale in ((3, 2, 16, 128, torch.bfloat16, 7.0),
                                          (100, 4, 64, 256, torch.bfloat16, 0.01),
                                          (128, 8, 16, 128, torch.float16, 300.0),
                                          (5, 2, 8, 9, torch.bfloat16, 0.0)):
    x = (torch.randn(n, heads, dim, generator=g) * scale).to(dtype)
    if n == 100:
        x[37, 1, 5] = -float(x.float().abs().max()) * 3  # the largest magnitude is negative
    got, descale = fa.quantize(x, rows)
    want, want_descale = want_codes(x, rows)
    assert got.dtype == E4M3 and got.shape == (rows, heads, dim), (got.dtype, got.shape)
    assert descale.shape == (1, 1, 1, 1) and float(descale) == float(want_descale)
    gf, wf = got.float(), want.float()
    # the interpreter's float32 -> fp8 cast drops the carry when rounding up crosses a power
    # of two (tests/unit/test_fp8_kernels.py), rounds exact ties away from zero, not to
    # even, and truncates some subnormals (the GPU's cvt does none of it; tests/gpu checks
    # its codes bit for bit): only there may the codes differ, by exactly that halving, to
    # the tie's other neighbour, or by one subnormal step (2^-9) below 2^-6
    exact = torch.zeros_like(wf)
    exact[:n] = x.float() * (torch.tensor(448.0) / x.float().abs().max().clamp(min=1e-30))
    carry = (wf != 0) & (wf.abs().log2() == wf.abs().log2().round()) & (gf == wf / 2)
    tie = (gf - exact).abs() == (wf - exact).abs()
    sub = (exact.abs() < 2.0 ** -6) & ((gf - wf).abs() <= 2.0 ** -9)
    assert ((gf == wf) | carry | tie | sub).all(), (n, dim)
    assert (gf != wf).float().mean() < 0.05, (n, dim)
    assert not gf[n:].any()  # the padding is zero codes
    if scale:
        assert float(gf.abs().max()) == 448.0

# v's rows as the QKV GEMM leaves them, columns of wider rows: read where they lie, the
# same codes as from a contiguous copy
wide = (torch.randn(70, 3 * 64, generator=g) * 2).to(torch.bfloat16)
v = wide[:, 128:].view(70, 4, 16)
assert not v.is_contiguous()
got, descale = fa.quantize(v, 128)
want, want_descale = fa.quantize(v.contiguous(), 128)
assert got.view(torch.uint8).equal(want.view(torch.uint8)) and descale.equal(want_descale)

# q's norm + RoPE in e4m3 (ops.norm_rope_fp8) against the test's float32 arithmetic: RMSNorm
# per head times w, rotate-half, times 448 / (max |w| sqrt(D)), one rounding; rows strided
# (q's columns of the QKV rows), with the interpreter's cast quirks as above
import math
from cpmoe import ops
T, heads, D = 37, 3, 16
x = (torch.randn(T, heads + 2, D, generator=g) * 3).to(torch.bfloat16)[:, :heads]
w = (torch.rand(D, generator=g) * 2).to(torch.bfloat16)
angle = torch.rand(T, D // 2, generator=g) * 6.3
cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
got, descale = ops.norm_rope_fp8(x, w, 1e-6, cos, sin)
assert got.dtype == E4M3 and got.shape == (T, heads, D) and descale.shape == (1,)
xf = x.float()
y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
c, sn = cos[:, None, :D // 2], sin[:, None, :D // 2]
y1, y2 = y[..., :D // 2], y[..., D // 2:]
y = torch.cat([y1 * c - y2 * sn, y2 * c + y1 * sn], -1)
bound = w.float().abs().max() * torch.tensor(math.sqrt(D))
assert abs(float(descale) - float(bound / 448)) <= 1e-6 * float(bound / 448)
exact = y * (torch.tensor(448.0) / bound)
wf, gf = exact.to(E4M3).float(), got.float()
carry = (wf != 0) & (wf.abs().log2() == wf.abs().log2().round()) & (gf == wf / 2)
near = (gf - exact).abs() <= (wf - exact).abs() + 1e-5 * exact.abs()  # ties, float32 ulps
sub = (exact.abs() < 2.0 ** -6) & ((gf - wf).abs() <= 2.0 ** -9)
assert ((gf == wf) | carry | near | sub).all()
assert (gf != wf).float().mean() < 0.05
# a served chunk's q in the store kernel (ops.qkv_norm_rope_store_fp8): the same codes and
# descale as norm_rope_fp8 on its q columns, and the same K/V in the pools as the 16-bit q
# store writes (e4m3 pools at a layer's scales)
kv_heads = 1
qkv = (torch.randn(T, (heads + 2 * kv_heads) * D + 8, generator=g) * 3).to(torch.bfloat16)
qkv = qkv[:, :(heads + 2 * kv_heads) * D]
slots = torch.randperm(64, generator=g)[:T]
kv_scale = torch.tensor([0.02, 0.01, 50.0, 100.0])
pools = [torch.zeros(4, 16, kv_heads, D, dtype=E4M3) for _ in range(4)]
q8, d8 = ops.qkv_norm_rope_store_fp8(qkv, heads, kv_heads, w, w, 1e-6, cos, sin, *pools[:2],
                                     slots, kv_scale)
q16 = ops.qkv_norm_rope_store(qkv, heads, kv_heads, w, w, 1e-6, cos, sin, *pools[2:], slots,
                              kv_scale)
want8, want_d8 = ops.norm_rope_fp8(qkv[:, :heads * D].reshape(T, heads, D), w, 1e-6, cos, sin)
assert q16.dtype == torch.bfloat16 and q8.view(torch.uint8).equal(want8.view(torch.uint8))
assert d8.equal(want_d8)
for got_pool, want_pool in zip(pools[:2], pools[2:]):
    assert got_pool.view(torch.uint8).equal(want_pool.view(torch.uint8))
    assert got_pool.view(torch.uint8).view(-1, kv_heads, D)[slots].any()

# O's dequantization into a slice of a larger 16-bit tensor, rows around it untouched
codes = (torch.randn(300, 4, 16, generator=g) * 40).to(E4M3)
descale = torch.tensor([0.0371])
out = torch.full((400, 4, 16), 5.0, dtype=torch.bfloat16)
back = fa.dequantize(codes, descale, out[50:350])
assert back.data_ptr() == out[50:350].data_ptr()
exact = codes.float() * descale
# bf16 keeps 8 significant bits: rounded to nearest (the GPU) it is within half a step of
# the float32 product, 2^-8 relative; the interpreter's cast truncates: within one step
err = (out[50:350].float() - exact).abs()
assert (err <= 2.0 ** -7 * exact.abs()).all()
assert (out[:50] == 5).all() and (out[350:] == 5).all()
print("fp8 attention kernels ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_quantize_and_dequantize_kernels_match_float32_in_the_interpreter():
    out = run_interpreted(_KERNEL_CASES, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fp8 attention kernels ok" in out.stdout
