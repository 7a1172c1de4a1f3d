"""What a model needs of the memory and the K/V dtype, known before the runner builds its
cache: --quantization applied to a config, --kv-cache-dtype checked against the model and the
device (FP8 prefill attention on CUDA), bytes per stored token and the memory per rank that
`cpmoe plan` reports."""

from __future__ import annotations


import torch

from cpmoe.cp.kv_cache import kv_cache_dtype
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import ParallelLayout


QUANTIZATIONS = ("fp8",)


def with_quantization(config, quantization: str | None):
    """The config with `--quantization fp8` applied: 16-bit weights are quantized to
    [128, 128] FP8 blocks at load; a checkpoint that is FP8 already stays as it is."""
    if quantization is None or config.quantization is not None:
        return config
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: only fp8 is supported")
    import dataclasses

    from cpmoe.config import Fp8Config
    return dataclasses.replace(config, quantization=Fp8Config(online=True))


def kv_cache_refusal(kv_dtype: str, model) -> str | None:
    """Why --kv-cache-dtype `kv_dtype` cannot apply to `model` (a model class or instance),
    or None: a model with its own per-sequence caches (DeepSeek-V4) takes only auto."""
    if kv_dtype == "auto" or not model.own_cache:
        return None
    return (f"--kv-cache-dtype {kv_dtype}: this model (DeepSeek-V4) keeps its own "
            f"per-sequence caches, not K/V pages; only auto applies to it")


def kv_scale_note(kv_dtype: str, scaled_layers: int) -> str | None:
    """The warning for K/V pools of --kv-cache-dtype `kv_dtype` given a checkpoint whose
    `scaled_layers` attention layers carry K/V-cache scales (as SGLang and vLLM warn), or
    None: FP8 pools without scales store K/V at scale 1; 16-bit pools ignore scales."""
    fp8 = kv_dtype != "auto"
    if fp8 and not scaled_layers:
        return (f"--kv-cache-dtype {kv_dtype}: the checkpoint has no k_scale/v_scale, so "
                f"K/V are stored at scale 1.0 (values past the format's largest, 448 for "
                f"e4m3, saturate)")
    if not fp8 and scaled_layers:
        return (f"the checkpoint's k_scale/v_scale ({scaled_layers} layers) are unused: "
                f"--kv-cache-dtype auto keeps K/V in the model's dtype")
    return None


def fp8_attention_applies(kv_dtype: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether --kv-cache-dtype `kv_dtype` also runs prefill attention in FP8: e4m3 pools of a
    16-bit model on CUDA (`cp.fp8_attention`, through cuDNN)."""
    return (kv_dtype == "fp8_e4m3" and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


def fp8_attention_refusal(kv_dtype: str, device: torch.device, dtype: torch.dtype
                          ) -> str | None:
    """One line when --kv-cache-dtype `kv_dtype` needs FP8 attention here and cuDNN's
    frontend is missing, else None."""
    if not fp8_attention_applies(kv_dtype, device, dtype):
        return None
    from cpmoe.cp.fp8_attention import install_hint
    return install_hint()


def kv_bytes_per_token(model, dtype: torch.dtype, kv_dtype: str) -> int:
    """K/V bytes of one stored token of `model` (in `dtype`) in pools of --kv-cache-dtype
    `kv_dtype`."""
    attn = model.model.layers[0].self_attn
    return (2 * len(model.model.layers) * attn.num_kv_heads * attn.head_dim
            * kv_cache_dtype(kv_dtype, dtype).itemsize)


def memory_per_rank(config, model_cls: type, layout: ParallelLayout, dtype: torch.dtype,
                    kv_dtype: str = "auto") -> list[dict[str, int | None]]:
    """Weight bytes and KV bytes per stored token (pools of --kv-cache-dtype `kv_dtype`) of
    every rank's shard, from shards built on the meta device (no memory, no processes). KV
    is None for models that keep their own per-sequence caches (DeepSeek-V4)."""
    out = []
    for rank in range(layout.world_size):
        with torch.device("meta"):
            model = model_cls(config, ProcessGroups.offline(layout, rank), dtype)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        quant = config.quantization
        fp8 = None
        if quant is not None:  # what the shard holds on CUDA, FP8 weights kept FP8
            from cpmoe.quant.modules import planned_weight_bytes
            fp8 = dict(zip(("weight_bytes", "fp8_bytes"),
                           planned_weight_bytes(model, quant, dtype)))
        kv = None if model.own_cache else kv_bytes_per_token(model, dtype, kv_dtype)
        out.append({"rank": rank, "weight_bytes": weights, "kv_bytes_per_token": kv,
                    **({"fp8_on_cuda": fp8} if fp8 else {})})
    return out
