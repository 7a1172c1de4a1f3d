"""Model configuration, parsed from an HF `config.json` in exactly one place.

Both the hub's key names (`num_experts`, `rope_theta`) and transformers 5's rewritten ones
(`num_local_experts`, `rope_parameters`) are accepted. Anything cpmoe cannot compute exactly
(another RoPE type, sliding-window attention) is refused with one line naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A checkpoint config cpmoe cannot serve; one line naming file and field."""


@dataclass(frozen=True)
class Fp8Config:
    """Block-scaled FP8 weights (`quantization_config` of an FP8 checkpoint, or
    `--quantization fp8`). W = q * s per [bn, bk] block of a [out, in] weight.

    The scale next to `X.weight` is `X.weight_scale_inv` (HF) or `X.scale` (DeepSeek-V4),
    float32 or ue8m0 (`scale_fmt`, read off each tensor's dtype by the loader).
    expert_dtype "fp4": routed experts are MXFP4 (e2m1 two per byte, one ue8m0 scale per 32
    inputs). online: quantized at load from 16-bit weights (`--quantization fp8`).
    """

    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"  # or "ue8m0"
    expert_dtype: str = "fp8"  # or "fp4"
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False

    def converts(self, module_name: str) -> bool:
        """Whether a Linear/experts module holds FP8 weights (transformers' matching of
        `modules_to_not_convert`: a prefix up to a module boundary, a regex, or a suffix)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{k}){boundary}", module_name) or module_name.endswith(k)
                       for k in self.modules_to_not_convert)


def parse_quantization(raw: dict, where: str = "config.json") -> Fp8Config | None:
    """`quantization_config` of a config.json -> Fp8Config, None when absent; one line
    naming the field for anything else."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not "
                          f"supported (only 'fp8')")
    for key, allowed in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)),
                         ("scale_fmt", ("ue8m0", "float")), ("expert_dtype", ("fp8", "fp4"))):
        value = q.get(key, raw.get(key) if key == "expert_dtype" else None)
        if value is not None and value not in allowed:
            raise ConfigError(f"{where}: quantization_config.{key} {value!r} is not supported "
                              f"(only {', '.join(map(repr, allowed))})")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size must be two positive "
                          f"integers [bn, bk] (per-tensor FP8 is not supported), got {block!r}")
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"{where}: quantization_config.modules_to_not_convert must be a list "
                          f"of module names, got {skip!r}")
    return Fp8Config(block=(block[0], block[1]), scale_fmt=q.get("scale_fmt") or "float",
                     expert_dtype=q.get("expert_dtype") or raw.get("expert_dtype") or "fp8",
                     modules_to_not_convert=tuple(skip))


@dataclass(frozen=True)
class QwenMoeConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen3-MoE)
    qkv_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int  # the context length the model was built for
    quantization: Fp8Config | None = None

    def is_sparse_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# transformers' value when config.json has none (Qwen2MoeConfig and Qwen3MoeConfig agree)
QWEN_DEFAULT_MAX_POSITIONS = 32768


def read_config_json(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (is --model a checkpoint directory?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable config ({e})") from None


def read_json_file(path: Path, flag: str, error: type[Exception]) -> object:
    """The JSON document a command-line flag names; `error` with one line naming the flag
    and file when it cannot be read or parsed."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise error(f"{flag} {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise error(f"{flag} {path}: not JSON ({e.msg} at line {e.lineno})") from None


def architecture_of(raw: dict, where: str) -> str:
    archs = raw.get("architectures") or []
    if len(archs) != 1:
        raise ConfigError(f"{where}: field 'architectures' must name one architecture, got {archs}")
    return archs[0]


def parse_qwen_moe(raw: dict, where: str = "config.json") -> QwenMoeConfig:
    arch = architecture_of(raw, where)
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{where}: unsupported architecture {arch!r}; supported: "
                          f"{', '.join(ARCHITECTURES)}")

    def need(key: str, *alts: str):
        for k in (key, *alts):
            if raw.get(k) is not None:
                return raw[k]
        raise ConfigError(f"{where}: missing field {key!r}")

    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (only 'default')")
    rope_theta = raw.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError(f"{where}: missing field 'rope_theta'")
    if raw.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported")
    qwen2 = arch == "Qwen2MoeForCausalLM"
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return QwenMoeConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        moe_intermediate_size=int(need("moe_intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        num_experts=int(need("num_experts", "num_local_experts")),
        num_experts_per_tok=int(need("num_experts_per_tok")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=(int(need("shared_expert_intermediate_size"))
                                         if qwen2 else 0),
        qkv_bias=bool(raw.get("qkv_bias", True)) if qwen2 else bool(raw.get("attention_bias",
                                                                             False)),
        qk_norm=not qwen2,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        max_position_embeddings=positive_field(raw, "max_position_embeddings", where,
                                               QWEN_DEFAULT_MAX_POSITIONS),
        quantization=parse_quantization(raw, where),
    )


def positive_field(raw: dict, key: str, where: str, default: int) -> int:
    """An integer field >= 1 (`default` when absent or null, as transformers reads it)."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: field {key!r} must be an integer >= 1, got {value!r}")
    return value


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
