"""Routed experts with block-FP8 weights on CUDA (LocalExperts' FP8 branch).

Every (row, slot) pair is sorted by local expert as on the bf16 grouped path
(`LocalExperts.sorted_slots`: other ranks' slots, id -1, sort last and are skipped by the
kernel), the rows are quantized per 1 x bk group (each token once; gate/up reads a slot's
token row where it loads it, no gathered copy), and two block-scaled grouped FP8
GEMMs (`ops.fp8_gemm.grouped_fp8_gemm`) run gate/up and down with the experts' own activation in
between (so DeepSeek-V4's clamped SwiGLU is kept): LocalExperts' own SwiGLU (plain or
clamped) is computed by the gate/up GEMM itself (`fused_swiglu`: it writes the [P, I]
activation, which quantize_act then reads), or, where that does not fit, with the down
GEMM's quantization in one kernel (`ops.fp8.swiglu_quantize`); an overridden activation
runs, then quantize_act.
Each row's weighted sum of its slots' outputs follows (`ops.weighted_row_sum`). With EP and
many slots (prefill) the local slot count is read once so other ranks' slots are not
gathered; with few slots (decode) nothing syncs with the host, so CUDA graphs can capture
it (other ranks' rows come out zero and weigh zero).

Legend: M rows, K top-k, H hidden, I local intermediate, P = M*K slots.
"""

from __future__ import annotations

import torch

from cpmoe.ops import launch, weighted_row_sum
from cpmoe.ops.fp8 import quantize_act, swiglu_quantize, swiglu_quantize_fits
from cpmoe.ops.fp8_gemm import grouped_fp8_config, grouped_fp8_gemm, grouped_fp8_tiles


def fp8_experts(experts, x_MH: torch.Tensor, local_ids_MK: torch.Tensor,
                weights_MK: torch.Tensor) -> torch.Tensor:
    block = experts.fp8_block
    rows_n, offs, n, rank_MK = experts.sorted_slots(local_ids_MK)
    if n == 0:
        return torch.zeros_like(x_MH)
    xq, xs = quantize_act(x_MH, block[1])  # per row: each row once, then its K slots
    # both GEMMs tile the same n rows of the same experts: one tile map for the two
    E = experts.gate_up_proj.shape[0]
    fused = fused_swiglu(experts, block)
    up_cfg = grouped_fp8_config(n, E, a_rows=True, swiglu=fused)
    if fused:  # a SwiGLU tile's gate and up columns each inside one weight scale block
        up_cfg["BN"] = min(up_cfg["BN"], block[0])
    down_cfg = grouped_fp8_config(n, E, after_swiglu=fused)
    assert up_cfg["BM"] == down_cfg["BM"]
    tiles = grouped_fp8_tiles(offs, n, E, up_cfg["BM"])
    # gate/up reads each slot's row of xq through rows_n (no gathered copy)
    h = grouped_fp8_gemm(xq, xs, experts.gate_up_proj, experts.gate_up_scale_inv, offs, block,
                         out_dtype=x_MH.dtype, config=up_cfg, tiles=tiles, a_rows=rows_n,
                         swiglu=fused, limit=experts.swiglu_limit)
    if fused:  # h is the SwiGLU already
        aq, a_s = quantize_act(h, block[1])
    else:
        aq, a_s = activate_and_quantize(experts, h, block[1])
    y = grouped_fp8_gemm(aq, a_s, experts.down_proj, experts.down_scale_inv, offs, block,
                         out_dtype=x_MH.dtype, config=down_cfg, tiles=tiles)
    w_MK = torch.where(local_ids_MK >= 0, weights_MK.to(y.dtype), 0)
    return weighted_row_sum(y, rank_MK, w_MK).to(x_MH.dtype)


def fused_swiglu(experts, block: tuple[int, int]) -> bool:
    """Whether gate/up computes the experts' SwiGLU itself (`grouped_fp8_gemm(swiglu=True)`:
    it writes the [P, I] activation, not the [P, 2I] gate and up rows, and the down GEMM's
    quantization reads half the bytes): LocalExperts' own SwiGLU, on the Triton path, over
    whole weight scale blocks of gate and of up."""
    inter = experts.gate_up_proj.shape[1] // 2
    return (experts.own_activation() and launch.use_triton(experts.gate_up_proj)
            and inter % block[0] == 0 and block[0] >= 16 and block[0] & (block[0] - 1) == 0)


def activate_and_quantize(experts, h_PI2: torch.Tensor, group: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' activation of packed gate/up rows, quantized per 1 x group: fused when
    the activation is LocalExperts' own SwiGLU, which `swiglu_quantize` computes."""
    if experts.own_activation() and swiglu_quantize_fits(h_PI2, group):
        return swiglu_quantize(h_PI2, group, experts.swiglu_limit)
    return quantize_act(experts.activation(h_PI2), group)
