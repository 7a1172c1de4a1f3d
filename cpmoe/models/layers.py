"""Building blocks shared by model files: the RMSNorm and RoPE families. The sharded linear
layer is cpmoe/linear.py; Qwen's fused q/k norm + rotate-half RoPE kernels are cpmoe/ops.py;
the interface every model declares is models/base.py."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe import ops
from cpmoe.linear import param
from cpmoe.ops import add_rms_norm

_ROW_KERNEL_MAX = 16384  # widest row `ops.rms_norm_fp32_weight` takes in one program


# ---- RMSNorm ---------------------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm`'s torch expression (see there for where the weight's dtype rounds)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (weight * normed).to(x.dtype)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean square in float32. The weight's dtype says where the
    result is rounded to x's dtype, as each model's reference does: a weight in the model
    dtype (HF Qwen) multiplies the rounded normed x; a float32 weight (DeepSeek-V4) multiplies
    first. (In float32 the two agree.) On CUDA in 16 bits either is one kernel pass
    (F.rms_norm for a bf16 weight, `ops.rms_norm_fp32_weight` for a float32 one)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps
        # set when an FP8 GEMM reads the output: `add_forward` then quantizes it per
        # 1 x quant_group in the same kernel on the GPU (ops.add_rms_norm)
        self.quant_group: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        same = self.weight.dtype == x.dtype
        if x.is_cuda and x.dtype == torch.bfloat16 and same:  # one fused kernel on the GPU
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
                and self.weight.dtype == torch.float32 and x.shape[-1] <= _ROW_KERNEL_MAX
                and ops.triton is not None):
            return ops.rms_norm_fp32_weight(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (self(x + residual), x + residual): one fused kernel on the GPU."""
        if (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
                and self.weight.dtype == x.dtype):
            return add_rms_norm(x, residual, self.weight, self.eps, self.quant_group)
        r = residual + x
        return self(r), r


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) with the scale rounded to x's dtype (DeepSeek-V4's per-head query norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ---- RoPE ------------------------------------------------------------------------------------

def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """Plain RoPE's inverse frequencies [dim/2]."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


class RotaryEmbedding(nn.Module):
    """cos/sin [T, R/2] of absolute positions (so CP permutations need nothing else), both
    times `scale` (YaRN's attention factor; 1 for plain RoPE)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """Interleaved RoPE (channel pairs 2i, 2i+1; DeepSeek-V4) on the trailing
    R = 2*cos.shape[-1] channels of x [T, ..., Dx]; the leading channels pass through. Pass
    -sin to rotate back. (Qwen's rotate-half RoPE is fused with its q/k norm: ops.norm_rope.)"""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.float().view(shape), sin.float().view(shape)
    pairs = x[..., -2 * half:].float().unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-2 * half], rotated], dim=-1)
