"""The declared model interface: what the engine, the loader, the CLI and the benchmarks may
call on a parsed model config (`ModelConfig`) and on a model class (`CausalLMHead`), with the
defaults a model overrides where it needs to. Nothing is looked up with getattr."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe.communicator import gather_output
from cpmoe.config import Fp8Config
from cpmoe.parallel.layout import ParallelLayout


class ModelConfig:
    """Base of every parsed config (a frozen dataclass built from config.json in the model's
    own `*_config.py`). Fields every config has: architecture, vocab_size, hidden_size,
    intermediate_size, moe_intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, num_experts, num_experts_per_tok, rms_norm_eps,
    tie_word_embeddings, eos_token_ids, max_position_embeddings, `is_sparse_layer(i)`."""

    quantization: Fp8Config | None = None  # FP8 checkpoint (or --quantization fp8)

    def check_layout(self, layout: ParallelLayout) -> None:
        """This model's own layout rules, beyond the ones every model has (registry's
        check_model_fit runs both); LayoutError with one line. No rules by default."""


class CausalLMHead(nn.Module):
    """The interface of a model class: what the engine, the loader and the benchmarks call,
    declared here with its defaults (a model overrides what it needs), and what every
    causal-LM wrapper shares: `self.model` (with `embed_tokens`), `self.lm_head` (None when
    tied to the embedding) and `self.groups`.

    - `__init__(config, groups, dtype)`: one rank's shard; `checkpoint_shapes(cfg)` (static):
      every tensor name and full shape of a hub checkpoint (random weights, the loader's
      completeness proof); `checkpoint_int_ranges(cfg)`: integer tensors and their ranges.
    - `checkpoint_param_name(name)`: a parameter's name in the checkpoint.
    - `own_cache`: False, the engine's paged K/V cache serves the model; True, the model
      keeps its own per-sequence caches (`make_kv_cache`) and brings its own decode graphs
      (`decode_graphs`); `can_capture_decode()`: whether its decode step may be captured;
      `decode_cache_for(cfg, layout, dtype)` (static): `cpmoe plan`'s line on that cache.
    - `fuse_weights()`, `hidden_states(batch)`, `logits(hidden)`.
    """

    own_cache = False

    @staticmethod
    def checkpoint_shapes(cfg) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    @staticmethod
    def checkpoint_int_ranges(cfg) -> dict[str, int] | None:
        """Integer checkpoint tensors -> exclusive upper bound of their values (none here)."""
        return None

    @staticmethod
    def checkpoint_param_name(name: str) -> str:
        return name

    @staticmethod
    def decode_cache_for(cfg, layout: ParallelLayout, dtype: torch.dtype) -> str | None:
        """None: the engine's paged K/V cache, which `cpmoe plan` describes itself."""
        return None

    def make_kv_cache(self, capacity: int):
        raise NotImplementedError(f"{type(self).__name__} uses the engine's paged K/V cache")

    def can_capture_decode(self) -> bool:
        """A paged model's decode step never syncs with the host (models/qwen_moe/model.py)."""
        return True

    def decode_graphs(self, runner, max_bs: int, max_context: int):
        raise NotImplementedError(f"{type(self).__name__}'s decode graphs are the engine's")

    def hidden_states(self, batch) -> torch.Tensor:
        """Final-normed hidden rows of every token in flat order, on every rank."""
        return gather_output(self.model(batch), batch, self.groups)

    def fuse_weights(self) -> None:
        """After loading, on the GPU: merge weights read by one input into one GEMM (the
        models that do override this; the default merges nothing)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = (self.model.embed_tokens.weight if self.lm_head is None
                  else self.lm_head.weight)
        return F.linear(hidden, weight)
