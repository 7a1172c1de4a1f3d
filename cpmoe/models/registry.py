"""Architecture name (config.json `architectures`) -> config parser and model class, and
whether a model fits a parallel layout (`check_model_fit`, every rule checked from here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from cpmoe.config import ConfigError, architecture_of, read_config_json
from cpmoe.models.base import ModelConfig
from cpmoe.models.qwen_moe.config import parse_qwen_moe
from cpmoe.moe.dispatch import check_backend_available
from cpmoe.parallel.layout import ParallelLayout


def _qwen() -> tuple[Callable, type]:
    from cpmoe.models.qwen_moe.model import QwenMoeForCausalLM
    return parse_qwen_moe, QwenMoeForCausalLM


def _deepseek_v4() -> tuple[Callable, type]:
    from cpmoe.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from cpmoe.models.deepseek_v4.config import parse_deepseek_v4
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


def check_model_fit(layout: ParallelLayout, cfg: ModelConfig) -> None:
    """Every rule on a model and a layout together, run before spawning ranks. The rules
    live in two homes: the layout's (ParallelLayout: its own, and the model's sizes against
    it) and the model's (`cfg.check_layout`); besides them, whether the process can run the
    MoE backend and, for an FP8 checkpoint, whether the cuts miss its scale blocks."""
    check_backend_available(layout.moe_a2a_backend)
    cfg.check_layout(layout)  # the model's own rules (DeepSeek-V4)
    layout.check_model(num_experts=cfg.num_experts, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads,
                       moe_intermediate_size=cfg.moe_intermediate_size,
                       intermediate_size=cfg.intermediate_size,
                       dense_layers=tuple(i for i in range(cfg.num_hidden_layers)
                                          if not cfg.is_sparse_layer(i)))
    quant = cfg.quantization
    if quant is not None and not quant.online:  # checkpoint blocks: cuts must not split them
        from cpmoe.quant.layout import check_fp8_layout
        check_fp8_layout(layout, cfg, model_class(cfg.architecture))
