"""Backend `alltoall`: rank-local dispatch/combine over the EP group (needs ep == tp).

Each rank sends only its own tokens (SCATTERED layout), one packed row per (token,
destination rank) carrying the hidden state, the token's top-k ids and weights (one
`all_to_all_single` after a count exchange; the receiver keeps the ids of its own experts);
works on gloo and NCCL. Experts return weighted rows; combine sends them back and sums, per
source token, over destinations. No collective touches ATTN_CP inside the MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.moe.dispatch.base import Dispatcher, pack_rows, unpack_rows
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
        _, token_S = sends_RN.nonzero(as_tuple=True)  # ordered by rank, then token
        send_counts = sends_RN.sum(dim=1)
        recv_counts = comm.exchange_counts(send_counts, group).tolist()  # host sync
        send_counts = send_counts.tolist()
        packed = pack_rows(x_NH, topk_ids_NK, topk_weights_NK)[token_S]
        recv = comm.all_to_all(packed, send_counts, recv_counts, group)
        recv_x, ids, recv_w = unpack_rows(recv, x_NH.shape[1], topk_ids_NK.shape[1])
        recv_ids = self.to_local(ids)
        handle = _Handle(token_S, send_counts, recv_counts, x_NH.shape[0])
        return recv_x, recv_ids, recv_w, handle

    def combine(self, y_MH: torch.Tensor, handle: _Handle) -> torch.Tensor:
        back_SH = comm.all_to_all(y_MH, handle.recv_counts, handle.send_counts,
                                  self.groups.moe_ep)
        out_NH = y_MH.new_zeros((handle.num_tokens, y_MH.shape[1]))
        return out_NH.index_add_(0, handle.token_S, back_SH)
