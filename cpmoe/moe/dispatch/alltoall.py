"""Backend `alltoall`: rank-local dispatch/combine over the EP group (needs ep == tp).

Each rank sends only its own tokens (SCATTERED layout), one row per (token, destination
rank) carrying the token's top-k ids (as the destination's local ids, -1 elsewhere) and
weights, with `all_to_all_single` after a count exchange; works on gloo and NCCL. Experts
return weighted rows; combine sends them back and sums, per source token, over destinations.
No collective touches ATTN_CP inside the MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.moe.dispatch.base import Dispatcher
from cpmoe.parallel import comm


@dataclass
class _Handle:
    token_S: torch.Tensor  # source token of every sent row, rows ordered by destination
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


class AllToAllDispatcher(Dispatcher):
    partial_output = False

    def dispatch(self, x_NH, topk_ids_NK, topk_weights_NK):
        group = self.groups.moe_ep
        dest_NK = topk_ids_NK // self.num_local_experts
        ranks = torch.arange(group.size, device=x_NH.device)
        sends_RN = (dest_NK[None, :, :] == ranks[:, None, None]).any(dim=-1)  # [ep, N]
        rank_S, token_S = sends_RN.nonzero(as_tuple=True)  # ordered by rank, then token
        local_SK = torch.where(dest_NK[token_S] == rank_S[:, None],
                               topk_ids_NK[token_S] - rank_S[:, None] * self.num_local_experts,
                               -1)
        send_counts = sends_RN.sum(dim=1)
        recv_counts = comm.exchange_counts(send_counts, group).tolist()  # host sync
        send_counts = send_counts.tolist()
        recv_x = comm.all_to_all(x_NH[token_S], send_counts, recv_counts, group)
        recv_ids = comm.all_to_all(local_SK, send_counts, recv_counts, group)
        recv_w = comm.all_to_all(topk_weights_NK[token_S], send_counts, recv_counts, group)
        handle = _Handle(token_S, send_counts, recv_counts, x_NH.shape[0])
        return recv_x, recv_ids, recv_w, self.count(recv_ids), handle

    def combine(self, y_MH: torch.Tensor, handle: _Handle) -> torch.Tensor:
        back_SH = comm.all_to_all(y_MH, handle.recv_counts, handle.send_counts,
                                  self.groups.moe_ep)
        out_NH = y_MH.new_zeros((handle.num_tokens, y_MH.shape[1]))
        return out_NH.index_add_(0, handle.token_S, back_SH)
