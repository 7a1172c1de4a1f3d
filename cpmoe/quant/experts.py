"""Routed experts with block-FP8 weights on CUDA (LocalExperts' FP8 branch).

Every (row, slot) pair is sorted by local expert (other ranks' slots, id -1, sort last and
are skipped by the kernel), the gathered rows are quantized per 1 x bk group, and two
block-scaled grouped FP8 GEMMs (kernels.grouped_fp8_gemm) run gate/up and down with the
experts' own activation in between (so DeepSeek-V4's clamped SwiGLU is kept); each row's
weighted sum of its slots' outputs follows (`ops.weighted_row_sum`). As on the bf16 grouped
path, with EP and many slots (prefill) the local slot count is read once so other ranks'
slots are not gathered; with few slots (decode) nothing syncs with the host, so CUDA graphs
can capture it (other ranks' rows come out zero and weigh zero).

Legend: M rows, K top-k, H hidden, I local intermediate, P = M*K slots.
"""

from __future__ import annotations

import torch

from cpmoe.moe.experts import _SYNC_MIN_SLOTS
from cpmoe.ops import weighted_row_sum
from cpmoe.quant.kernels import grouped_fp8_gemm, quantize_act


def fp8_experts(experts, x_MH: torch.Tensor, local_ids_MK: torch.Tensor,
                weights_MK: torch.Tensor) -> torch.Tensor:
    M, K = local_ids_MK.shape
    E = experts.num_local_experts
    block = experts.fp8_block
    expert_P = torch.where(local_ids_MK >= 0, local_ids_MK, E).flatten()
    sorted_P, order = torch.sort(expert_P, stable=True)
    bounds = torch.arange(1, E + 1, device=x_MH.device, dtype=sorted_P.dtype)
    offs = torch.searchsorted(sorted_P, bounds)
    sparse = experts.shard[1] > 1
    n = int(offs[-1]) if sparse and M * K > _SYNC_MIN_SLOTS else M * K
    if n == 0:
        return torch.zeros_like(x_MH)
    rank_P = torch.empty_like(order)
    rank_P[order] = torch.arange(M * K, device=order.device)
    xq, xs = quantize_act(x_MH[order[:n] // K], block[1])
    h = grouped_fp8_gemm(xq, xs, experts.gate_up_proj, experts.gate_up_scale_inv, offs, block,
                         out_dtype=x_MH.dtype)
    aq, a_s = quantize_act(experts.activation(h), block[1])
    y = grouped_fp8_gemm(aq, a_s, experts.down_proj, experts.down_scale_inv, offs, block,
                         out_dtype=x_MH.dtype)
    w_MK = torch.where(local_ids_MK >= 0, weights_MK.to(y.dtype), 0)
    return weighted_row_sum(y, rank_P.view(M, K).clamp(max=n - 1), w_MK).to(x_MH.dtype)
