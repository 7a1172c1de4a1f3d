"""Merging partial attention results computed over disjoint keys.

- `merge_partials(o, lse)`: P partial attention outputs [P, T, H, D] with their
  log-sum-exps [P, T, H] -> the exact result, fp32 (o = sum_i exp(lse_i - lse) * o_i,
  lse = logsumexp_i(lse_i); a part that saw no key, lse -inf, weighs zero).
- `merge_two_attention(o1, lse1, o2, lse2, out)`: its P = 2 case written into out in one
  Triton pass (CP prefill: a query run's own keys and the keys before it).
"""

from __future__ import annotations

import torch

from cpmoe.ops import launch
from cpmoe.ops.launch import tl, triton


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [P, T, H, D] and lse [P, T, H] of P parts -> merged o [T, H, D] (fp32)."""
    total = torch.logsumexp(lse, dim=0)  # [T, H]
    weight = torch.exp(lse - total.nan_to_num(neginf=0.0)[None])  # -inf parts -> 0
    return (weight[..., None] * o.float()).sum(dim=0)


def merge_two_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                        lse2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """merge_partials of two parts (o_i [T, H, D], lse_i [T, H]) written into out [T, H, D]
    (any strides); returns out. One pass over the inputs: the unfused expression moves ~9x
    the bytes (fp32 temporaries)."""
    T, H, D = o1.shape
    if (not launch.use_triton(o1) or T == 0 or D & (D - 1) or o1.stride(2) != 1
            or o2.stride(2) != 1 or out.stride(2) != 1):
        return out.copy_(merge_partials(torch.stack([o1.float(), o2.float()]),
                                        torch.stack([lse1, lse2])))
    block = 64
    _merge_two_kernel[(triton.cdiv(T, block), H)](
        o1, lse1, o2, lse2, out, T, o1.stride(0), o1.stride(1), o2.stride(0), o2.stride(1),
        lse1.stride(0), lse1.stride(1), lse2.stride(0), lse2.stride(1), out.stride(0),
        out.stride(1), BLOCK=block, D=D)
    return out



if triton is not None:
    # a size that changes every step: no specialization on it (Triton would compile a
    # new variant, ~1 s, for each new residue mod 16 it meets while serving)
    @triton.jit(do_not_specialize=["T", "l1_st", "l1_sh", "l2_st", "l2_sh"])
    def _merge_two_kernel(o1_ptr, l1_ptr, o2_ptr, l2_ptr, out_ptr, T, o1_st, o1_sh, o2_st,
                          o2_sh, l1_st, l1_sh, l2_st, l2_sh, out_st, out_sh,
                          BLOCK: tl.constexpr, D: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        ok = rows < T
        l1 = tl.load(l1_ptr + rows * l1_st + h * l1_sh, mask=ok, other=float("-inf"))
        l2 = tl.load(l2_ptr + rows * l2_st + h * l2_sh, mask=ok, other=float("-inf"))
        m = tl.maximum(l1, l2)
        m = tl.where(m == float("-inf"), 0.0, m)
        w1, w2 = tl.exp(l1 - m), tl.exp(l2 - m)
        total = w1 + w2
        total = tl.where(total == 0.0, 1.0, total)
        w1, w2 = (w1 / total)[:, None], (w2 / total)[:, None]
        d = tl.arange(0, D)[None, :]
        o1 = tl.load(o1_ptr + rows[:, None] * o1_st + h * o1_sh + d, mask=ok[:, None],
                     other=0.0).to(tl.float32)
        o2 = tl.load(o2_ptr + rows[:, None] * o2_st + h * o2_sh + d, mask=ok[:, None],
                     other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * out_st + h * out_sh + d,
                 (w1 * o1 + w2 * o2).to(out_ptr.dtype.element_ty), mask=ok[:, None])
