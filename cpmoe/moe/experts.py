"""This rank's shard of the routed experts: experts [ep_rank*E_loc, (ep_rank+1)*E_loc), each
sliced along the intermediate dim over MoE-TP (so outputs are partial sums over moe_tp).

Parameter names and layouts follow HF transformers 5 (`gate_up_proj` [E, 2I, H] with gate
rows first, `down_proj` [E, H, I]); the loader fills them from the hub's per-expert tensors.

Legend: M = received rows, H = hidden, K = top-k, E = local experts, I = local intermediate.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe.linear import param
from cpmoe.moe import fused_moe
from cpmoe.ops import clamped_swiglu, silu_and_mul, weighted_row_sum


class LocalExperts(nn.Module):
    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, shard: tuple[int, int, int, int] = (0, 1, 0, 1)) -> None:
        super().__init__()
        E, H, I = num_local_experts, hidden_size, intermediate_size
        self.num_local_experts = E
        self.shard = shard  # (ep_rank, ep_size, moe_tp_rank, moe_tp_size), read by the loader
        self.gate_up_proj = param(E, 2 * I, H, dtype=dtype)
        self.down_proj = param(E, H, I, dtype=dtype)
        self.swiglu_limit: float | None = None  # clamped SwiGLU (DeepSeek-V4): see activation

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU of gate/up rows packed [.., 2I] (gate first) -> [.., I]; with swiglu_limit,
        DeepSeek-V4's clamped form (`ops.clamped_swiglu`). A model with another gated
        activation overrides this; the fused decode kernel, which computes only these two,
        then stands aside."""
        if self.swiglu_limit is None:
            return silu_and_mul(h)
        return clamped_swiglu(*h.chunk(2, dim=-1), self.swiglu_limit)

    def own_activation(self) -> bool:
        """Whether `activation` is this class's SwiGLU (not a subclass's override): the
        fused kernels, which compute only it, serve these experts."""
        return type(self).activation is LocalExperts.activation

    def forward(self, x_MH: torch.Tensor, local_ids_MK: torch.Tensor,
                weights_MK: torch.Tensor) -> torch.Tensor:
        """Weighted sum over each row's local experts (id -1: expert not on this rank)."""
        fp8 = self.gate_up_proj.dtype == torch.float8_e4m3fn  # FP8 weights (cpmoe/quant)
        if (x_MH.is_cuda and self.own_activation()
                and fused_moe.usable(x_MH, local_ids_MK.numel())  # decode: few rows
                and (not fp8 or fused_moe.takes_block_scales(self))):
            scales = (self.gate_up_scale_inv, self.down_scale_inv) if fp8 else None
            return fused_moe.fused_experts(x_MH, local_ids_MK, weights_MK, self.gate_up_proj,
                                           self.down_proj, scales, self.swiglu_limit)
        if fp8:
            from cpmoe.moe.fp8_experts import fp8_experts
            return fp8_experts(self, x_MH, local_ids_MK, weights_MK)
        if x_MH.is_cuda and x_MH.dtype == torch.bfloat16 and _grouped_mm is not None:
            return self._forward_grouped(x_MH, local_ids_MK, weights_MK)
        return self._forward_loop(x_MH, local_ids_MK, weights_MK)

    def _forward_loop(self, x_MH, local_ids_MK, weights_MK) -> torch.Tensor:
        """Reference path (CPU): one matmul pair per expert that received rows."""
        out_MH = torch.zeros_like(x_MH)
        row_P, slot_P = (local_ids_MK >= 0).nonzero(as_tuple=True)
        if row_P.numel() == 0:
            return out_MH
        expert_P = local_ids_MK[row_P, slot_P]
        order = torch.argsort(expert_P, stable=True)
        row_P, slot_P, expert_P = row_P[order], slot_P[order], expert_P[order]
        counts = torch.bincount(expert_P, minlength=self.num_local_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = row_P[start:start + n]
            y = F.linear(self.activation(F.linear(x_MH[rows], self.gate_up_proj[e])),
                         self.down_proj[e])
            y = y * weights_MK[rows, slot_P[start:start + n], None]
            out_MH.index_add_(0, rows, y.to(out_MH.dtype))
            start += n
        return out_MH

    def sorted_slots(self, local_ids_MK: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """The grouped paths' order (bf16 here, FP8 in moe/fp8_experts.py): every (row, slot)
        pair sorted by local expert, slots of other EP ranks' experts (id -1) last, past the
        last group -> (rows_n: the source row of each of the first n sorted pairs, offs: each
        expert's end among them (int64 [E]), n, rank_MK: where each pair's output row lands,
        clamped to n - 1, a valid row, for the pairs not computed, which weigh zero).
        With EP > 1 and many pairs (prefill) n is the local count, read once per layer (the
        only host sync), so no gather or GEMM work is spent on other ranks' slots; with few
        (decode) n is every pair: no sync, so CUDA graphs can capture it."""
        M, K = local_ids_MK.shape
        E = self.num_local_experts
        # A narrow sort key (a radix sort makes a pass per key byte, 8 for int64): uint8
        # when it takes every id, -1 (other ranks' experts) becoming 255, past them all
        if E < 255:
            key, expert_P = torch.uint8, local_ids_MK.flatten().to(torch.uint8)
        else:
            key, expert_P = torch.int32, torch.where(local_ids_MK >= 0, local_ids_MK, E
                                                     ).flatten().to(torch.int32)
        sorted_P, order = torch.sort(expert_P, stable=True)
        bounds = torch.arange(1, E + 1, device=local_ids_MK.device, dtype=key)
        offs = torch.searchsorted(sorted_P, bounds)
        sparse = self.shard[1] > 1  # EP: some slots belong to other ranks
        n = int(offs[-1]) if sparse and M * K > _SYNC_MIN_SLOTS else M * K
        rank_P = torch.empty_like(order)  # rank of every pair in the sorted order
        rank_P[order] = torch.arange(M * K, device=order.device)
        rank_MK = rank_P.view(M, K)  # ranks past n - 1 only where n < M * K
        return order[:n] // K, offs, n, rank_MK.clamp(max=n - 1) if n < M * K else rank_MK

    def _forward_grouped(self, x_MH, local_ids_MK, weights_MK) -> torch.Tensor:
        """Grouped-GEMM path (GPU): the pairs in `sorted_slots` order, two grouped GEMMs for
        all experts, then each row's weighted sum of its slots' outputs in one pass
        (`ops.weighted_row_sum`: no [M, K, H] intermediate). grouped_mm leaves rows past the
        last group unwritten, and nothing reads them."""
        rows_n, offs, n, rank_MK = self.sorted_slots(local_ids_MK)
        if n == 0:
            return torch.zeros_like(x_MH)
        offs = offs.to(torch.int32)
        h = _grouped_mm(x_MH[rows_n], self.gate_up_proj.transpose(1, 2), offs=offs)
        y = _grouped_mm(self.activation(h), self.down_proj.transpose(1, 2), offs=offs)
        # slots of other ranks' experts weigh zero (their row index is any valid one)
        w_MK = torch.where(local_ids_MK >= 0, weights_MK.to(y.dtype), 0)
        return weighted_row_sum(y, rank_MK, w_MK).to(x_MH.dtype)


# Below this many (row, slot) pairs the grouped path never reads a count to the host.
_SYNC_MIN_SLOTS = 4096
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
