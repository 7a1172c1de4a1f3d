"""DeepSeek-V4's per-head query norm and interleaved RoPE as one in-place Triton pass.

    head_norm_rope_(x_ThD, cos_TR, sin_TR, eps, norm=True, sin_sign=1.0) -> x_ThD

does what `apply_interleaved_rope(unweighted_rms_norm(x, eps), cos, sin)` does (without the
norm when norm=False; sin_sign=-1 rotates back, as passing -sin does) and writes the result
over x. Why: at 16K tokens the queries [T, 64, 512] are 1 GiB in bf16. The torch expressions
made a float32 copy (2 GiB), its square, the mean, the scaled product, then rotated the
trailing channels and wrote the whole row again with `torch.cat` (about 11 GiB of traffic
per layer, ~3 ms on an H200); here x is read once and written once (2 GiB). Without the norm
(the output's inverse rotation) only the rotated channels are read and written.

Rounding as the torch expressions: the norm's scale is rounded to x's dtype and the product
to x's dtype; the rotation reads those rounded values and cos/sin in float32 and rounds once.
The mean of squares sums in another order (a few float32 ulps).

Legend: T rows, h heads, D head dim, R/2 = cos.shape[-1] (rotated channel pairs, trailing).
Inputs: x [T, h, D] 16-bit or float32 (the interpreter tests), last dim contiguous, other
strides free; cos, sin [T, R/2], last dim contiguous, R even and <= D.
"""

from __future__ import annotations

import torch

from cpmoe._triton import import_triton

triton, tl = import_triton()

BLOCK_HEADS, NUM_WARPS = 4, 4


def head_norm_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                    norm: bool = True, sin_sign: float = 1.0,
                    block_heads: int = BLOCK_HEADS) -> torch.Tensor:
    """See the module docstring -> x, rewritten in place."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"head_norm_rope_: need x [T, h, D] with a contiguous last axis, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    T, h, D = x.shape
    half = cos.shape[-1]
    if (cos.shape != (T, half) or sin.shape != cos.shape or 2 * half > D
            or cos.stride(1) != 1 or sin.stride(1) != 1):
        raise ValueError(f"head_norm_rope_: need cos and sin [T={T}, R/2 <= {D // 2}] with a "
                         f"contiguous last axis, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if triton is None:
        raise RuntimeError("head_norm_rope_ needs Triton (on CUDA or its interpreter)")
    if T == 0 or h == 0:
        return x
    first = 0 if norm else D - 2 * half  # the first channel a program reads
    grid = (T, triton.cdiv(h, block_heads))
    _head_norm_rope_kernel[grid](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), h, D, D - 2 * half,
        first, eps, sin_sign, NORM=norm, BLOCK_H=block_heads,
        BLOCK_D=triton.next_power_of_2(D - first), num_warps=NUM_WARPS)
    return x


if triton is not None:
    @triton.jit
    def _head_norm_rope_kernel(x_ptr, cos_ptr, sin_ptr, x_st, x_sh, c_st, s_st, h, D, r0,
                               first, eps, sin_sign, NORM: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col = first + tl.arange(0, BLOCK_D)
        ok = (heads < h)[:, None] & (col < D)[None, :]
        rows = x_ptr + t * x_st + heads.to(tl.int64)[:, None] * x_sh
        partner = col ^ 1  # channel pairs (2i, 2i+1) counted from r0, which is even
        y = tl.load(rows + col[None, :], mask=ok, other=0.0).to(tl.float32)
        yp = tl.load(rows + partner[None, :], mask=ok & (partner < D)[None, :],
                     other=0.0).to(tl.float32)
        if NORM:
            ms = tl.sum(y * y, axis=1) / D
            scale = (1.0 / tl.sqrt(ms + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
            y = (y * scale[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            yp = (yp * scale[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        pair = tl.maximum(col - r0, 0) // 2
        rot = col >= r0
        c = tl.load(cos_ptr + t * c_st + pair, mask=rot & (col < D), other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * s_st + pair, mask=rot & (col < D), other=0.0).to(tl.float32)
        s = s * sin_sign
        odd = ((col - r0) % 2) == 1
        # even channel a: a c - b s; odd channel b: b c + a s (a, b the pair)
        signed = tl.where(odd, s, -s)
        rotated = y * c[None, :] + yp * signed[None, :]
        out = tl.where(rot[None, :], rotated, y)
        tl.store(rows + col[None, :], out.to(x_ptr.dtype.element_ty), mask=ok)
