"""What every model's config parsing shares: reading config.json, its architecture name,
the FP8 `quantization_config`, checked integer fields, `--dtype`. Each model's own config is
parsed in one place next to the model (models/qwen_moe/config.py, models/deepseek_v4/config.py).
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
    if method == "compressed-tensors":
        return _kv_cache_only(q, where)
    if method != "fp8":
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not "
                          f"supported (only 'fp8', or 'compressed-tensors' with a "
                          f"kv_cache_scheme only)")
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


def _kv_cache_only(q: dict, where: str) -> None:
    """An llm-compressor (compressed-tensors) quantization_config that quantizes only the
    K/V cache: 16-bit weights (no config_groups) and a per-tensor FP8 kv_cache_scheme, whose
    k_scale / v_scale tensors the loader reads (quant/kv_scales.py) -> no weight quantization.
    Anything else is one line naming the field."""
    groups = q.get("config_groups") or {}
    if groups:
        raise ConfigError(f"{where}: quantization_config.config_groups: compressed-tensors "
                          f"weight quantization is not supported (only a kv_cache_scheme over "
                          f"16-bit weights), got groups {sorted(groups)}")
    kv = q.get("kv_cache_scheme")
    if kv is None:
        return None
    want = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    for key, value in want.items():
        if not isinstance(kv, dict) or kv.get(key, value) != value:
            got = kv.get(key) if isinstance(kv, dict) else kv
            raise ConfigError(f"{where}: quantization_config.kv_cache_scheme.{key} {got!r} is "
                              f"not supported (only {value!r}: one static FP8 scale per "
                              f"layer for K and for V)")
    return None


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
