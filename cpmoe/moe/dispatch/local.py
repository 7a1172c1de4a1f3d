"""Backend `none`: no tokens move. Every rank of the MoE group holds the same tokens (FULL or
MOE_FULL layout), runs its expert shard on all of them, and the communicator sums the
partial outputs over the MoE group afterwards."""

from __future__ import annotations

import torch

from cpmoe.moe.dispatch.base import Dispatcher


class LocalDispatcher(Dispatcher):
    partial_output = True

    def dispatch(self, x_NH, topk_ids_NK, topk_weights_NK):
        return x_NH, self.to_local(topk_ids_NK), topk_weights_NK, None

    def combine(self, y_MH: torch.Tensor, handle) -> torch.Tensor:
        return y_MH
