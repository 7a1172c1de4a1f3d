"""Building blocks shared by model files: RMSNorm, rotary embedding, and the interface of a
model class (`CausalLMHead`). The sharded linear layer is cpmoe/linear.py."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe.communicator import gather_output
from cpmoe.linear import param
from cpmoe.ops import add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.bfloat16:  # one fused kernel on the GPU
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (self(x + residual), x + residual): one fused kernel on the GPU."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            return add_rms_norm(x, residual, self.weight, self.eps)
        r = residual + x
        return self(r), r


class RotaryEmbedding(nn.Module):
    """Default RoPE on absolute positions (so CP permutations need nothing else)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


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
      (`decode_graphs`); `can_capture_decode()`: whether its decode step may be captured.
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

    def make_kv_cache(self, capacity: int):
        raise NotImplementedError(f"{type(self).__name__} uses the engine's paged K/V cache")

    def can_capture_decode(self) -> bool:
        """A paged model's decode step never syncs with the host (models/qwen_moe.py)."""
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
