"""The token-dispatch interface every MoE backend implements (the factory is the package's
`create_dispatcher`).

    dispatch(x_NH, topk_ids_NK, topk_weights_NK)
        -> (recv_x_MH, recv_local_ids_MK, recv_weights_MK, handle)
    combine(y_MH, handle) -> out_NH

x_NH: this rank's tokens in the MoE layout of the backend (rows of the source rank).
topk_ids_NK: global expert ids (int64); topk_weights_NK: routing weights, x's dtype.
recv_local_ids_MK: ids of this rank's experts (0..E_loc-1), -1 where the expert lives
elsewhere; the experts reduce each received row over its local slots, already weighted.
combine returns, for every source row, the sum of what the experts sent back for it.
Whether `out_NH` is final or a partial sum over the MoE group is a property of the backend
(`partial_output`); the communicator does the reduction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from cpmoe.parallel.groups import ProcessGroups


class Dispatcher(ABC):
    partial_output: bool  # True: combine's result still needs a sum over the MoE group

    def __init__(self, groups: ProcessGroups, num_experts: int) -> None:
        self.groups = groups
        self.num_local_experts = num_experts // groups.layout.ep_size
        self.first_expert = groups.moe_ep.rank * self.num_local_experts

    @abstractmethod
    def dispatch(self, x_NH: torch.Tensor, topk_ids_NK: torch.Tensor,
                 topk_weights_NK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]: ...

    @abstractmethod
    def combine(self, y_MH: torch.Tensor, handle: Any) -> torch.Tensor: ...

    def to_local(self, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.groups.layout.ep_size == 1:  # every expert is local: ids are already local
            return topk_ids
        local = topk_ids - self.first_expert
        return torch.where((local >= 0) & (local < self.num_local_experts), local, -1)


def pack_rows(x_NH: torch.Tensor, topk_ids_NK: torch.Tensor, topk_weights_NK: torch.Tensor
              ) -> torch.Tensor:
    """One tensor per row for one collective: [hidden | ids as int32 bits | weights], all
    in x's dtype (ids are reinterpreted, not converted, so they survive any dtype)."""
    ids = topk_ids_NK.to(torch.int32).contiguous().view(x_NH.dtype)
    return torch.cat([x_NH, ids, topk_weights_NK.to(x_NH.dtype)], dim=1)


def unpack_rows(packed: torch.Tensor, hidden: int, top_k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (x rows [a view], global ids int64, weights), the inverse of pack_rows."""
    id_cols = packed.shape[1] - hidden - top_k
    ids = packed[:, hidden:hidden + id_cols].contiguous().view(torch.int32).long()
    return packed[:, :hidden], ids, packed[:, hidden + id_cols:]
