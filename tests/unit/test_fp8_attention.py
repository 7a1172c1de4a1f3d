"""What `--kv-cache-dtype fp8_e4m3` decides before any GPU work (the CUDA kernel itself:
tests/gpu/test_fp8_attention_cuda.py): when prefill attention runs in FP8, the one line a
machine without cuDNN's frontend gets, the graph buckets, and the device-side quantization
(checked on CPU: the same torch ops)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.cp import fp8_attention as fa
from cpmoe.engine.sizing import fp8_attention_applies, fp8_attention_refusal

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
