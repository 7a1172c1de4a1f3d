"""Qwen3-MoE / Qwen2-MoE configuration, parsed from an HF `config.json` in this one place.

Both the hub's key names (`num_experts`, `rope_theta`) and transformers 5's rewritten ones
(`num_local_experts`, `rope_parameters`) are accepted. Anything cpmoe cannot compute exactly
(another RoPE type, sliding-window attention) is refused with one line naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpmoe.config import (ConfigError, Fp8Config, architecture_of, parse_quantization,
                          positive_field)
from cpmoe.models.base import ModelConfig


@dataclass(frozen=True)
class QwenMoeConfig(ModelConfig):
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
