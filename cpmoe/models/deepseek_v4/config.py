"""DeepSeek-V4 configuration (parsed from an HF `config.json` in this one place) and the
layout rules V4 adds on top of `ParallelLayout`'s own.

Accepts what transformers' `save_pretrained` writes (nested `rope_parameters` with `main`
and `compress` entries, `layer_types`, `mlp_layer_types`, `compress_rates`) and the older
flat spellings transformers itself still folds in (`compress_ratios`, `num_hash_layers`,
`compress_rate_csa/hca`, flat YaRN `rope_scaling`). Anything cpmoe cannot compute exactly is
refused with one line naming the field. Multi-token-prediction layers are not built.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpmoe.config import (ConfigError, Fp8Config, architecture_of, parse_quantization,
                          positive_field)
from cpmoe.models.base import ModelConfig
from cpmoe.moe.dispatch import check_backend_available
from cpmoe.parallel.layout import LayoutError, ParallelLayout

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
HASH_MOE, MOE = "hash_moe", "moe"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_SCORING = ("sqrtsoftplus", "sigmoid")
DEFAULT_MAX_POSITIONS = 1048576  # transformers' DeepseekV4Config value when config.json has none

DECODE_CACHE_NOTE = ("DeepSeek-V4 decode: each CP rank keeps its share of every sequence's "
                     "compressed KV and indexer keys (entry c on CP rank c % attn_cp); the "
                     "bounded sliding window and open compressor windows are replicated; "
                     "partial attention of every rank is merged by LSE.")


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table ('main' or 'compress'): default or YaRN inverse frequencies."""

    theta: float
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: YaRN's 0.1*ln(factor)+1 (or mscale ratio)
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class DeepseekV4Config(ModelConfig):
    architecture: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_dim: int  # trailing channels of each head that get RoPE (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    num_experts_per_tok: int
    mlp_layer_types: tuple[str, ...]
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_main: RopeSpec
    rope_compress: RopeSpec
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int  # the context length the model was built for
    quantization: Fp8Config | None = None

    # The names the engine's generic checks (`check_model_fit`, `cpmoe plan`) read.
    num_key_value_heads = 1  # one shared KV head, read as both key and value

    @property
    def intermediate_size(self) -> int:
        return self.moe_intermediate_size  # no dense MLP layers; the shared expert's width

    def is_sparse_layer(self, layer: int) -> bool:
        return True  # every V4 layer is MoE (hash-routed or top-k)

    def compress_rate(self, layer: int) -> int:
        """0 for sliding-window-only layers."""
        return {SLIDING: 0, CSA: self.compress_rate_csa,
                HCA: self.compress_rate_hca}[self.layer_types[layer]]

    def check_layout(self, layout: ParallelLayout) -> None:
        check_v4_layout(layout)


def check_v4_layout(layout: ParallelLayout) -> None:
    """V4 layout rules, run before spawning ranks (and again in every runner).

    Attention is never head-sharded: its single shared KV head and grouped output projection
    stay whole, so every rank of the replica is an attention-CP rank (attn_cp == tp). Either
    CP split strategy is exact (K-side inputs are gathered in flat order). MoE backends:
    `none`, `alltoall`, or an external one whose package is installed (the rule every model
    has, `check_backend_available`, named here so this function states V4's whole rule)."""
    tp, cp = layout.tp_size, layout.attn_cp_size
    if cp != tp:
        raise LayoutError(f"DeepSeek-V4 attention is not head-sharded: --attn-cp-size {cp} "
                          f"must equal --tp-size {tp}")
    check_backend_available(layout.moe_a2a_backend)


def _rope_spec(d: dict, where: str, label: str) -> RopeSpec:
    kind = d.get("rope_type", d.get("type", "default"))
    if d.get("rope_theta") is None:
        raise ConfigError(f"{where}: rope_parameters[{label!r}] lacks 'rope_theta'")
    if kind == "default":
        return RopeSpec(theta=float(d["rope_theta"]))
    if kind != "yarn":
        raise ConfigError(f"{where}: rope_parameters[{label!r}] rope_type {kind!r} is not "
                          f"supported (only 'default' and 'yarn')")
    if d.get("original_max_position_embeddings") is None or d.get("factor") is None:
        raise ConfigError(f"{where}: YaRN rope_parameters[{label!r}] needs 'factor' and "
                          f"'original_max_position_embeddings'")

    def opt(key: str) -> float | None:
        return None if d.get(key) is None else float(d[key])

    return RopeSpec(theta=float(d["rope_theta"]), rope_type="yarn", factor=float(d["factor"]),
                    original_max_position_embeddings=int(d["original_max_position_embeddings"]),
                    beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow")
                                                                               or 1),
                    attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                    mscale_all_dim=opt("mscale_all_dim"))


def _rope_dicts(raw: dict, partial: float) -> tuple[dict, dict]:
    """(main, compress) rope dicts. Flat configs follow transformers: main is plain RoPE on
    rope_theta; compress takes the flat (YaRN) fields on compress_rope_theta, and a YaRN
    compress table defaults to attention_factor 1 (the V4 reference applies no mscale)."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0),
            "partial_rotary_factor": partial}
    compress = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0),
                "partial_rotary_factor": partial}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _layer_types(raw: dict, n: int, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        types = [_RATIO_TO_TYPE.get(r, f"compress ratio {r}") for r in raw["compress_ratios"]]
    if types is None:  # transformers' default: 2x HCA, then CSA/HCA interleaved
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp = raw.get("mlp_layer_types")
    if mlp is None:
        n_hash = raw.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlp = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    types, mlp = tuple(types[:n]), tuple(mlp[:n])
    for name, got, allowed in (("layer_types", types, (SLIDING, CSA, HCA)),
                               ("mlp_layer_types", mlp, (HASH_MOE, MOE))):
        if len(got) != n:
            raise ConfigError(f"{where}: {name} has {len(got)} entries for {n} layers")
        bad = [t for t in got if t not in allowed]
        if bad:
            raise ConfigError(f"{where}: {name} entry {bad[0]!r} is not one of "
                              f"{', '.join(allowed)}")
    return types, mlp


def parse_deepseek_v4(raw: dict, where: str = "config.json") -> DeepseekV4Config:
    arch = architecture_of(raw, where)
    if arch != "DeepseekV4ForCausalLM":
        raise ConfigError(f"{where}: architecture {arch!r} is not DeepseekV4ForCausalLM")

    def need(key: str):
        if raw.get(key) is None:
            raise ConfigError(f"{where}: missing field {key!r}")
        return raw[key]

    for key, want in (("num_key_value_heads", 1), ("n_shared_experts", 1),
                      ("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise ConfigError(f"{where}: {key}={raw[key]!r} is not supported (only {want!r})")
    n = int(need("num_hidden_layers"))
    head_dim = int(need("head_dim"))
    partial = raw.get("partial_rotary_factor")
    if partial is None:
        partial = (raw["qk_rope_head_dim"] / head_dim if raw.get("qk_rope_head_dim")
                   else 64 / 512)
    main, compress = _rope_dicts(raw, float(partial))
    rope_dims = {int(head_dim * d.get("partial_rotary_factor", 1.0)) for d in (main, compress)}
    if len(rope_dims) != 1 or min(rope_dims) % 2:
        raise ConfigError(f"{where}: main and compress RoPE must rotate the same even number "
                          f"of channels, got {sorted(rope_dims)}")
    rates = dict(raw.get("compress_rates") or {})
    csa = int(raw.get("compress_rate_csa") or rates.get(CSA, 4))
    hca = int(raw.get("compress_rate_hca") or rates.get(HCA, 128))
    types, mlp = _layer_types(raw, n, where)
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in _SCORING:
        raise ConfigError(f"{where}: scoring_func {scoring!r} is not one of {', '.join(_SCORING)}")
    heads, groups = int(need("num_attention_heads")), int(need("o_groups"))
    if heads % groups:
        raise ConfigError(f"{where}: o_groups {groups} must divide num_attention_heads {heads}")
    eos = raw.get("eos_token_id")
    return DeepseekV4Config(
        architecture=arch, vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        moe_intermediate_size=int(need("moe_intermediate_size")),
        num_hidden_layers=n, num_attention_heads=heads, head_dim=head_dim,
        rope_dim=rope_dims.pop(), q_lora_rank=int(need("q_lora_rank")), o_groups=groups,
        o_lora_rank=int(need("o_lora_rank")), sliding_window=int(need("sliding_window")),
        layer_types=types, compress_rate_csa=csa, compress_rate_hca=hca,
        index_n_heads=int(need("index_n_heads")), index_head_dim=int(need("index_head_dim")),
        index_topk=int(need("index_topk")), num_experts=int(need("n_routed_experts")),
        num_experts_per_tok=int(need("num_experts_per_tok")), mlp_layer_types=mlp,
        scoring_func=scoring, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)), hc_mult=int(need("hc_mult")),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_main=_rope_spec(main, where, "main"),
        rope_compress=_rope_spec(compress, where, "compress"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None
                                                                  else (int(eos),)),
        max_position_embeddings=positive_field(raw, "max_position_embeddings", where,
                                               DEFAULT_MAX_POSITIONS),
        quantization=parse_quantization(raw, where),
    )
