"""What `--kv-cache-dtype fp8_e4m3` decides before any GPU work (the CUDA kernel itself:
tests/gpu/test_fp8_attention_cuda.py): when prefill attention runs in FP8, the one line a
machine without cuDNN's frontend gets, the graph buckets, and the device-side quantization:
its torch path on CPU, and its Triton kernels (the amax, the scale-and-cast with the bucket's
padding, O's dequantization) in Triton's CPU interpreter against the test's own float32
arithmetic (a subprocess: TRITON_INTERPRET is read at import; skipped without Triton)."""

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
