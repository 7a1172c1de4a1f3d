"""Building blocks shared by model files: sharded linear layers, RMSNorm, rotary embedding.

A `Linear` knows how its checkpoint tensor is cut for this rank (`shard`): None for
replicated, ("rows", index, parts) for column parallel (output features split),
("cols", index, parts) for row parallel (input features split), or ("head", index, size)
for one replicated KV head block. The loader reads that and nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe.communicator import gather_output
from cpmoe.ops import add_rms_norm

Shard = tuple[str, int, int] | None


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 shard: Shard = None) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@torch.no_grad()
def fuse_linears(linears: list[Linear]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """One GEMM computing every given Linear's outputs, concatenated, as a function of x;
    each module's weight (and bias, and FP8 block scales) becomes a view into the fused
    tensors, so no memory is added, a later write to either is seen by both, and the
    parameters stay as they were (the fused tensors are not parameters). FP8 linears fuse
    when every output width is whole scale blocks. None where they cannot be fused (mixed
    module types, dtypes, blocks or biases)."""
    kinds = {(type(m), m.weight.dtype, m.weight.shape[1], m.bias is None,
              getattr(m, "block", None)) for m in linears}
    if len(kinds) != 1:
        return None
    fp8 = linears[0].weight.dtype == torch.float8_e4m3fn
    if type(linears[0]) is not Linear and not (
            fp8 and all(m.weight.shape[0] % m.block[0] == 0 for m in linears)):
        return None
    weight = _fuse_rows(linears, "weight")
    bias = None if linears[0].bias is None else _fuse_rows(linears, "bias")
    if not fp8:
        return functools.partial(F.linear, weight=weight, bias=bias)
    from cpmoe.quant.kernels import fp8_linear, scaled_mm_weight_scale
    scale = _fuse_rows(linears, "weight_scale_inv")
    return functools.partial(fp8_linear, w=weight, w_scale=scale, block=linears[0].block,
                             bias=bias, mm_scale=scaled_mm_weight_scale(scale))


def _fuse_rows(linears: list[Linear], name: str) -> torch.Tensor:
    """The modules' `name` tensors concatenated along rows; each becomes a view into it."""
    fused = torch.cat([getattr(m, name) for m in linears])
    start = 0
    for m in linears:
        n = getattr(m, name).shape[0]
        setattr(m, name, nn.Parameter(fused[start:start + n], requires_grad=False))
        start += n
    return fused


def column_shard(rank: int, size: int) -> Shard:
    return ("rows", rank, size) if size > 1 else None


def row_shard(rank: int, size: int) -> Shard:
    return ("cols", rank, size) if size > 1 else None


def kv_head_shard(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, Shard]:
    """(local KV heads, shard): heads split when there are at least tp of them, otherwise
    each rank keeps the one head its query heads read (KV heads replicated)."""
    if tp_size == 1:
        return num_kv_heads, None
    if num_kv_heads >= tp_size:
        return num_kv_heads // tp_size, ("rows", tp_rank, tp_size)
    return 1, ("rows", tp_rank * num_kv_heads // tp_size, num_kv_heads)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
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
