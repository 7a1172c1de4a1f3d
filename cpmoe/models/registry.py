"""Architecture name (config.json `architectures`) -> config parser and model class."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from cpmoe.config import ConfigError, architecture_of, parse_qwen_moe, read_config_json


def _qwen() -> tuple[Callable, type]:
    from cpmoe.models.qwen_moe import QwenMoeForCausalLM
    return parse_qwen_moe, QwenMoeForCausalLM


def _deepseek_v4() -> tuple[Callable, type]:
    from cpmoe.models.deepseek_v4 import DeepseekV4ForCausalLM
    from cpmoe.models.deepseek_v4_config import parse_deepseek_v4
    return parse_deepseek_v4, DeepseekV4ForCausalLM


_REGISTRY: dict[str, Callable[[], tuple[Callable, type]]] = {
    "Qwen3MoeForCausalLM": _qwen,
    "Qwen2MoeForCausalLM": _qwen,
    "DeepseekV4ForCausalLM": _deepseek_v4,
}


def load_model_config(model_dir: Path) -> tuple[Any, type]:
    """-> (parsed config, model class); ConfigError with one line for anything unsupported."""
    return config_from_dict(read_config_json(model_dir), str(Path(model_dir) / "config.json"))


def config_from_dict(raw: dict, where: str = "config.json") -> tuple[Any, type]:
    """An HF config.json's contents -> (parsed config, model class)."""
    arch = architecture_of(raw, where)
    if arch not in _REGISTRY:
        raise ConfigError(f"{where}: unsupported architecture {arch!r}; supported: "
                          f"{', '.join(sorted(_REGISTRY))}")
    parse, model_cls = _REGISTRY[arch]()
    return parse(raw, where), model_cls


def model_class(architecture: str) -> type:
    """The model class of a (registered) architecture name."""
    return _REGISTRY[architecture]()[1]
