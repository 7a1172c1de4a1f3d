"""What a benchmark run is made of: model shapes, layout strings, lengths, model FLOPs.

Pure functions, no processes: everything here is checked in the parent before any rank is
spawned, and a mistake is one line (`BenchError`, `LayoutError` or `ConfigError`).

Model FLOPs of a prefill (the utilisation numerator, for both cpmoe and HF):
    2 * tokens * active_params + 2 * layers * q_heads * head_dim * sum_i L_i^2
active_params counts the weights one token meets in the decoder layers and the final norm;
the embedding and the LM head are left out (both engines compute last-token logits only).
The second term is causal attention (QK^T and PV over the visible half of each L_i x L_i).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cpmoe.config import read_json_file
from cpmoe.bench.v4_flops import v4_prefill_flops
from cpmoe.models.deepseek_v4.config import DeepseekV4Config
from cpmoe.models.qwen_moe.config import ARCHITECTURES, QwenMoeConfig
from cpmoe.models.registry import check_model_fit, config_from_dict
from cpmoe.parallel.layout import LayoutError, ParallelLayout

# MFU's denominator is the datasheet peak, the field's convention (and what peers report);
# the measured matmul ceiling is a second column, never the only one.
H200_BF16_PEAK_FLOPS = 989e12  # H200 SXM dense bf16, NVIDIA datasheet (no sparsity)
H200_BF16_MEASURED_FLOPS = 790e12  # measured dense bf16 matmul ceiling (notes/gpu-envelope.md)
# H200 (and H100) SXM dense FP8 e4m3, NVIDIA datasheet: the denominator of a --quantization
# fp8 run's MFU, whose GEMMs run on FP8 tensor cores (no FP8 ceiling is measured: no second
# column for it)
H200_FP8_PEAK_FLOPS = 1979e12


class BenchError(ValueError):
    """Bad benchmark input other than a layout or a config; one line naming the flag."""


_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 262144,
    "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645,
}

_TINY = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 32768,
    "use_sliding_window": False, "eos_token_id": 1,
}

SHAPES = {"qwen3-30b-a3b": _QWEN3_30B_A3B, "tiny": _TINY}


def read_shape(shape: str | None, config_path: Path | None) -> tuple[str, dict]:
    """--shape NAME or --config FILE -> (name for reports, HF config.json contents)."""
    if config_path is not None:
        raw = read_json_file(config_path, "--config", BenchError)
        if not isinstance(raw, dict):
            raise BenchError(f"--config {config_path}: expected a JSON object")
        return Path(config_path).stem, raw
    if shape not in SHAPES:
        raise BenchError(f"--shape {shape!r}: expected one of {', '.join(SHAPES)} "
                         f"(or --config FILE)")
    return shape, dict(SHAPES[shape])


def parse_config(raw: dict, where: str):
    """-> the parsed model config (QwenMoeConfig, ...); ConfigError for anything unsupported."""
    cfg, _ = config_from_dict(raw, where)
    return cfg


def parse_lengths(text: str) -> list[int]:
    """'4096,16384' -> sorted distinct lengths (shortest first: it carries the logit check)."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--lengths {text!r}: expected comma-separated integers") from None
    if not lengths or min(lengths) < 1:
        raise BenchError(f"--lengths {text!r}: expected positive integers")
    return sorted(set(lengths))


# ---- layouts ---------------------------------------------------------------------------

_INT_KEYS = {"tp": "tp_size", "cp": "attn_cp_size", "dp": "moe_dp_size", "ep": "ep_size"}
_STR_KEYS = {"backend": "moe_a2a_backend", "strategy": "cp_strategy"}
# Not part of the parallel layout: how the experts are placed over the EP ranks.
# static: the fixed split; balanced: before each length, by the expert load of one
# calibration prefill of another random prompt of that length (moe/placement.py).
PLACEMENTS = ("static", "balanced")


@dataclass(frozen=True)
class BenchLayout:
    name: str  # canonical: tp first, then only the keys that differ from the defaults
    layout: ParallelLayout
    placement: str = "static"

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def sizes(self) -> dict:
        return {k: v for k, v in self.layout.summary().items() if k != "groups"}


def parse_layout(text: str) -> BenchLayout:
    """'tp=2,cp=2,ep=2,backend=alltoall' -> a validated layout (defaults 1,1,1,1,none,zigzag;
    placement=static)."""
    kwargs: dict[str, object] = {}
    placement = None
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise LayoutError(f"--layouts {text!r}: expected key=value, got {item.strip()!r}")
        if key == "placement":
            if placement is not None:
                raise LayoutError(f"--layouts {text!r}: placement given twice")
            if value not in PLACEMENTS:
                raise LayoutError(f"--layouts {text!r}: placement={value!r}, expected one of "
                                  f"{', '.join(PLACEMENTS)}")
            placement = value
            continue
        if key not in _INT_KEYS and key not in _STR_KEYS:
            raise LayoutError(f"--layouts {text!r}: unknown key {key!r}; keys: "
                              f"{', '.join([*_INT_KEYS, *_STR_KEYS, 'placement'])}")
        field = _INT_KEYS.get(key) or _STR_KEYS[key]
        if field in kwargs:
            raise LayoutError(f"--layouts {text!r}: {key} given twice")
        if key in _INT_KEYS:
            try:
                kwargs[field] = int(value)
            except ValueError:
                raise LayoutError(f"--layouts {text!r}: {key}={value!r} is not an "
                                  f"integer") from None
        else:
            kwargs[field] = value
    try:
        layout = ParallelLayout(**kwargs)  # type: ignore[arg-type]
    except LayoutError as e:
        raise LayoutError(f"--layouts {text!r}: {e}") from None
    if placement == "balanced" and layout.ep_size == 1:
        raise LayoutError(f"--layouts {text!r}: placement=balanced needs ep > 1 (with ep=1 "
                          f"every rank holds every expert)")
    placement = placement or "static"
    return BenchLayout(layout_name(layout, placement), layout, placement)


def layout_name(layout: ParallelLayout, placement: str = "static") -> str:
    default = ParallelLayout()
    parts = [f"tp={layout.tp_size}"]
    for key, field in [*_INT_KEYS.items(), *_STR_KEYS.items()][1:]:
        if getattr(layout, field) != getattr(default, field):
            parts.append(f"{key}={getattr(layout, field)}")
    if placement != "static":
        parts.append(f"placement={placement}")
    return ",".join(parts)


def parse_layouts(text: str, cfg) -> list[BenchLayout]:
    """Several layouts separated by ';', each checked against the model (and its backend)."""
    items = [t.strip() for t in text.split(";") if t.strip()]
    if not items:
        raise LayoutError(f"--layouts {text!r}: no layout given")
    out = []
    for item in items:
        bl = parse_layout(item)
        try:
            check_model_fit(bl.layout, cfg)
        except LayoutError as e:
            raise LayoutError(f"--layouts {item!r}: {e}") from None
        out.append(bl)
    return out


# ---- FLOPs -----------------------------------------------------------------------------

def active_params(cfg) -> int | None:
    """Weights one token meets, embedding and LM head excluded; None if not a Qwen-MoE."""
    if not isinstance(cfg, QwenMoeConfig) or cfg.architecture not in ARCHITECTURES:
        return None
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    attn = H * q + 2 * H * kv + q * H + 2 * H  # q, k, v, o projections + the two layer norms
    if cfg.qkv_bias:
        attn += q + 2 * kv
    if cfg.qk_norm:
        attn += 2 * D
    total = H  # final norm
    for layer in range(cfg.num_hidden_layers):
        total += attn
        if not cfg.is_sparse_layer(layer):
            total += 3 * H * cfg.intermediate_size
            continue
        total += cfg.num_experts * H  # router
        total += cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
        if cfg.shared_expert_intermediate_size:
            total += 3 * H * cfg.shared_expert_intermediate_size + H  # shared expert + gate
    return total


def model_flops(cfg, seq_lens: list[int]) -> float | None:
    """Prefill FLOPs of a batch (the module docstring's formula); None if not a Qwen-MoE."""
    if isinstance(cfg, DeepseekV4Config):  # V4 has its own formula: cpmoe/bench/v4_flops.py
        return v4_prefill_flops(cfg, seq_lens)
    params = active_params(cfg)
    if params is None:
        return None
    attn = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return 2.0 * sum(seq_lens) * params + attn * float(sum(n * n for n in seq_lens))


MFU_FORMULA = ("mfu = model_flops / seconds / (989e12 datasheet dense bf16 peak * GPUs of the "
               "layout); mfu_vs_measured = the same over the measured 790e12 matmul ceiling; "
               "--quantization fp8 rows: mfu_fp8 over the 1979e12 datasheet dense FP8 peak "
               "instead (the bf16 columns empty); "
               "model_flops = 2*tokens*active_params + 2*layers*q_heads*head_dim*sum(L_i^2); "
               "active_params excludes embedding and lm_head (logits of the last token only)")


def mfu(flops: float | None, seconds: float | None, gpus: int,
        peak: float = H200_BF16_PEAK_FLOPS) -> float | None:
    """Model FLOPs utilisation against `peak` FLOP/s per GPU (default: the datasheet peak)."""
    if not flops or not seconds or seconds <= 0:
        return None
    return flops / seconds / (peak * gpus)
