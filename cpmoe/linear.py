"""The sharded linear layer every model builds on, and the rules that cut it over ranks.

A `Linear` knows how its checkpoint tensor is cut for this rank (`shard`): None for
replicated, ("rows", index, parts) for column parallel (output features split),
("cols", index, parts) for row parallel (input features split), or ("head", index, size)
for one replicated KV head block. The loader reads that and nothing else; FP8 swaps it for
an `Fp8Linear` (quant/modules.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Shard = tuple[str, int, int] | None


def param(*shape: int, dtype: torch.dtype, device: torch.device | None = None
          ) -> nn.Parameter:
    """An uninitialised, frozen parameter: the loader (or random weights) fills it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 shard: Shard = None) -> None:
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)
        self.bias = param(out_features, dtype=dtype) if bias else None
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
    from cpmoe.ops.fp8_gemm import fp8_linear, scaled_mm_weight_scale
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
