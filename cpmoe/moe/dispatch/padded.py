"""Backend `alltoall_padded`: rank-local dispatch/combine with no device-to-host sync.

Every rank sends each of its rows to every EP rank in equal-sized all-to-alls (the
communicator gives every rank the same number of rows in the SCATTERED layout), with the
top-k ids rewritten as the destination's local ids (-1 where the expert lives elsewhere) and
the weights. Nothing about counts has to reach the host, so the GPU stream never stalls;
the price is that a row also travels to EP ranks that own none of its experts. With top-8
of 128 experts over 2 ranks almost every row needs both ranks anyway (1 - 2^-8), so the
bytes match `alltoall`; with wide EP they do not (choose by measurement: bench/dispatch.py).
"""

from __future__ import annotations

import torch

from cpmoe.moe.dispatch.base import Dispatcher
from cpmoe.parallel import comm


class PaddedAllToAllDispatcher(Dispatcher):
    partial_output = False

    def dispatch(self, x_NH, topk_ids_NK, topk_weights_NK):
        group = self.groups.moe_ep
        ep, N = group.size, x_NH.shape[0]
        counts = [N] * ep
        ranks = torch.arange(ep, device=x_NH.device)[:, None, None]
        local_RNK = topk_ids_NK[None] - ranks * self.num_local_experts
        owned = (local_RNK >= 0) & (local_RNK < self.num_local_experts)
        local_RNK = torch.where(owned, local_RNK, -1)
        recv_x = comm.all_to_all(x_NH.repeat(ep, 1), counts, counts, group)
        recv_ids = comm.all_to_all(local_RNK.reshape(ep * N, -1), counts, counts, group)
        recv_w = comm.all_to_all(topk_weights_NK.repeat(ep, 1), counts, counts, group)
        return recv_x, recv_ids, recv_w, self.count(recv_ids), N

    def combine(self, y_MH: torch.Tensor, handle: int) -> torch.Tensor:
        ep, N = self.groups.moe_ep.size, handle
        back = comm.all_to_all(y_MH, [N] * ep, [N] * ep, self.groups.moe_ep)
        return back.reshape(ep, N, -1).sum(dim=0)
