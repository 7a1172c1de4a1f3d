"""SwiGLU and the MoE combine: one Triton kernel each on CUDA, the torch reference elsewhere.

- `silu_and_mul(h)`: SwiGLU of gate/up rows packed as [.., 2I] (gate first) -> [.., I].
- `clamped_swiglu(gate, up, limit)`: DeepSeek-V4's SwiGLU with clamped inputs.
- `swiglu_act` (in kernels): the one SwiGLU expression every kernel uses (also
  `fp8.swiglu_quantize`'s), so their results agree bit for bit.
- `weighted_row_sum(y, index, weight)`: out[m] = sum_k weight[m, k] * y[index[m, k]]
  (the MoE combine: every row's weighted sum of its top-k expert outputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpmoe.ops import launch
from cpmoe.ops.launch import tl, triton

# ---- SwiGLU ----------------------------------------------------------------------------

def silu_and_mul_ref(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's SwiGLU: SiLU(min(gate, limit)) * clamp(up, -limit, limit). On CUDA in
    16 bits one kernel pass (the torch expression makes four: two clamps, the SiLU and the
    product, ~4 GB of traffic per MoE layer at 16K tokens); elsewhere the expression."""
    if (gate.is_cuda and gate.dtype in (torch.bfloat16, torch.float16) and gate.dim() == 2
            and launch.use_triton(gate)):
        return clamped_swiglu_triton(gate, up, limit)
    return clamped_swiglu_ref(gate, up, limit)


def clamped_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`clamped_swiglu_ref` in one pass: gate and up [M, I] (any row strides, e.g. the two
    halves of packed [M, 2I] rows), SiLU and product in fp32, rounded once -> new [M, I]."""
    if gate.shape != up.shape or gate.dim() != 2 or up.dtype != gate.dtype:
        raise ValueError(f"clamped_swiglu: need gate and up [M, I] of one dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype}, {tuple(up.shape)} {up.dtype}")
    return _swiglu(gate, up, limit)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    if not launch.use_triton(h) or h.shape[0] == 0:
        return silu_and_mul_ref(h)
    return _swiglu(*h.contiguous().chunk(2, dim=-1), None)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) * up of [M, I] rows (inputs clamped first when limit is given), one
    Triton pass -> new [M, I]."""
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    n, inter = gate.shape
    out = gate.new_empty((n, inter))
    if n == 0 or inter == 0:
        return out
    block = 1024
    _swiglu_kernel[(n, triton.cdiv(inter, block))](
        gate, up, out, gate.stride(0), up.stride(0), inter, 0.0 if limit is None else limit,
        CLAMP=limit is not None, BLOCK=block)
    return out


# ---- MoE combine -----------------------------------------------------------------------

def weighted_row_sum_ref(y: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
                         ) -> torch.Tensor:
    """out[m] = sum_k weight[m, k] * y[index[m, k]]; a zero weight reads nothing (its row may
    be memory no GEMM wrote, NaN included), as in the kernel."""
    M, K = index.shape
    w = weight.flatten().float()[:, None]
    rows = torch.where(w != 0, y[index.flatten()].float() * w, 0.0)
    return rows.view(M, K, -1).sum(dim=1).to(y.dtype)


def weighted_row_sum(y: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
                     ) -> torch.Tensor:
    if not launch.use_triton(y) or index.shape[0] == 0:
        return weighted_row_sum_ref(y, index, weight)
    y, index, weight = y.contiguous(), index.contiguous(), weight.contiguous()
    M, K = index.shape
    H = y.shape[1]
    out = y.new_empty((M, H))
    block = min(1024, triton.next_power_of_2(H))
    _weighted_row_sum_kernel[(M, triton.cdiv(H, block))](y, index, weight, out, H, K=K,
                                                         BLOCK=block)
    return out


# ---- q/k norm + rotary -------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def swiglu_act(gate, up, limit, CLAMP: tl.constexpr):
        """SiLU(gate) * up of float32 tiles, the inputs clamped first with CLAMP
        (`clamped_swiglu_ref`'s bounds): the one expression of every SwiGLU kernel, so
        their results agree bit for bit."""
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, g_st, u_st, inter, limit,
                       CLAMP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gate_ptr + row * g_st + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * u_st + cols, mask=mask, other=0.0).to(tl.float32)
        act = swiglu_act(gate, up, limit, CLAMP)
        tl.store(out_ptr + row * inter + cols, act.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _weighted_row_sum_kernel(y_ptr, index_ptr, weight_ptr, out_ptr, hidden,
                                 K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            src = tl.load(index_ptr + row * K + k).to(tl.int64)
            w = tl.load(weight_ptr + row * K + k).to(tl.float32)
            # a zero weight (a slot of another EP rank's expert) reads nothing
            used = mask & ((tl.zeros([BLOCK], dtype=tl.float32) + w) != 0.0)
            vals = tl.load(y_ptr + src * hidden + cols, mask=used, other=0.0)
            acc += w * vals.to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
