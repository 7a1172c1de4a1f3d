"""Backend `alltoall_padded`: rank-local dispatch/combine with no device-to-host sync.

Every rank sends each of its rows to every EP rank (the communicator gives every rank the
same number of rows in the SCATTERED layout), so the exchange is an all-gather of packed
rows (hidden state, top-k ids, weights: one collective) and the way back a reduce-scatter
that sums each source row's partial outputs inside NCCL. Nothing about counts reaches the
host, so the GPU stream never stalls; the price is that a row also travels to EP ranks that
own none of its experts. With top-8 of 128 experts over 2 ranks almost every row needs both
ranks anyway (1 - 2^-8), so the bytes match `alltoall`; with wide EP they do not (choose by
measurement: python3 -m cpmoe.bench.dispatch).
"""

from __future__ import annotations

import torch

from cpmoe.moe.dispatch.base import Dispatcher, pack_rows, unpack_rows
from cpmoe.parallel import comm


class PaddedAllToAllDispatcher(Dispatcher):
    partial_output = False

    def dispatch(self, x_NH, topk_ids_NK, topk_weights_NK):
        packed = comm.all_gather(pack_rows(x_NH, topk_ids_NK, topk_weights_NK),
                                 self.groups.moe_ep)
        recv_x, ids, recv_w = unpack_rows(packed, x_NH.shape[1], topk_ids_NK.shape[1])
        return recv_x, self.to_local(ids), recv_w, None

    def combine(self, y_MH: torch.Tensor, handle) -> torch.Tensor:
        return comm.reduce_scatter(y_MH, self.groups.moe_ep)
