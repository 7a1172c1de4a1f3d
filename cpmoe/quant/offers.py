"""Rows quantized by the kernel that wrote them.

A kernel that writes activations an FP8 GEMM reads next (the RMSNorm before q/k/v and before
the experts, decode attention's split merge before o_proj) can quantize them in the same pass
and offer the result: `offer_quantized(x, q, s, group)`. `quant.kernels.quantize_act` of those
rows then returns (q, s) instead of launching (`offered`). One offer is held at a time: each
producer's rows are consumed before the next producer runs.
"""

from __future__ import annotations

import weakref

import torch

_OFFER: list[tuple] = []  # [(weakref to the tensor owning the rows, key of the rows, q, s)]


def offer_quantized(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> None:
    """x [M, K] quantized per 1 x `group` as quantize_act would (q, s [M, K/group] with
    strides (1, M)). The offer holds while x's memory is alive and unwritten by torch (a
    kernel writing through a raw pointer bumps no version: offer fresh outputs only)."""
    owner = x if x._base is None else x._base
    _OFFER[:] = [(weakref.ref(owner), _rows_key(x, group), q, s)]


def offered(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The offer for these rows, if any: the same memory (its owner alive, so not reused),
    viewed the same way, not written since (views share one version counter)."""
    if not _OFFER:
        return None
    owner, key, q, s = _OFFER[0]
    if owner() is None:
        _OFFER.clear()
        return None
    return (q, s) if _rows_key(x, group) == key else None


def _rows_key(x: torch.Tensor, group: int) -> tuple:
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x._version, group)
