"""DeepSeek-V4 prefill's sparse sink attention as one Triton kernel: each query row attends
its own list of key rows of a shared pool, without gathering them first.

    sparse_sink_attention(q_THD, pool_MD, idx_TS, valid_TS, sinks_H, scale, out=None,
                          lens=None) -> o_THD

equals `prefill.sink_attention(q_THD, pool_MD[idx_TS], valid_TS, sinks_H,
scale)`: row t's keys are pool rows idx[t, s] where valid[t, s] (K = V, one shared KV
head); each head's softmax also holds its sink logit sinks[h], whose probability mass is
dropped, so a row with no valid key gives o = 0. lens [T] (optional): row t's valid keys
all lie in its first lens[t] (the kernel reads no further).

Legend: T query rows, H query heads, D head dim, M pool rows, S keys per row.

Inputs: q [T, H, D] and pool [M, D] of one dtype (bf16/fp16 on the GPU; float32 runs with
IEEE fp32 dots, for the interpreter tests), last dims contiguous, other strides free (the
pool may be a column slice of the K-side rows); idx [T, S] int64 or int32 with every valid
entry in [0, M) (invalid entries are never read); valid [T, S] bool; sinks [H] finite,
any float dtype. Output in q's dtype, written into `out` ([T, H, D], last dim contiguous)
when given. lens: int32/int64, values in [0, S].

Kernel: one program per (row, block of BLOCK_H heads), the head blocks of a row adjacent in
launch order so they meet its key rows in L2. It loads the row's q tile [BLOCK_H, D] once,
walks its S keys BLOCK_N at a time (index and mask blocks, then the [BLOCK_N, D] key rows
gathered from the pool), forms scores with tl.dot (fp32 accumulation), and keeps an online
softmax in fp32 (log2 domain) whose running max and sum start at the sink (max = sink,
sum = exp(sink - max) = 1), so the sink is in every denominator and a row with no valid
key ends with acc = 0. o = acc / sum, rounded once. The value product takes p rounded to
the key dtype (bf16 tensor cores), as flash attention does.

Sizes that change every block (S and the index/mask row strides; T only sizes the grid) are
not specialized on, so a prefill compiles one variant per dtype, pool stride and config, not
one per new residue mod 16.
"""

from __future__ import annotations

import math
import os

import torch

from cpmoe._triton import import_triton

triton, tl = import_triton()

# Defaults for D = 512, the fastest of `python3 -m bench.v4_sparse_attention --lengths 16384
# --sweep` on the H200 at 9b4f34c (54 option sets): all 64 heads of a row in one program, so
# its keys are gathered once, not once per 16 heads; 64-key tiles, 8 warps, 2 stages: 6.96
# ms (187 TFLOP/s) where the former 16 heads x 32 keys at 4 warps took 24.8 ms (53).
BLOCK_H, BLOCK_N, NUM_WARPS, NUM_STAGES = 64, 64, 8, 2


def kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prefill runs the kernel: CUDA, a 16-bit dtype, Triton installed. float32 and
    CPU keep the torch reference (the interpreter tests call the kernel directly)."""
    return (triton is not None and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


def _check_inputs(q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                  sinks: torch.Tensor, out: torch.Tensor | None,
                  lens: torch.Tensor | None = None) -> None:
    """Shape/dtype/layout checks only (no value is read, so no host sync)."""
    if q.dim() != 3 or pool.dim() != 2 or pool.shape[1] != q.shape[2]:
        raise ValueError(f"sparse_sink_attention: need q [T, H, D] and pool [M, D], got "
                         f"{tuple(q.shape)} and {tuple(pool.shape)}")
    T, H, _ = q.shape
    if idx.dim() != 2 or idx.shape[0] != T or valid.shape != idx.shape:
        raise ValueError(f"sparse_sink_attention: need idx and valid [T={T}, S], got "
                         f"{tuple(idx.shape)} and {tuple(valid.shape)}")
    if idx.dtype not in (torch.int32, torch.int64) or valid.dtype != torch.bool:
        raise ValueError(f"sparse_sink_attention: idx must be int32/int64 and valid bool, got "
                         f"{idx.dtype} and {valid.dtype}")
    if pool.dtype != q.dtype or sinks.shape != (H,):
        raise ValueError(f"sparse_sink_attention: need pool in q's dtype {q.dtype} (got "
                         f"{pool.dtype}) and sinks [{H}] (got {tuple(sinks.shape)})")
    if q.stride(2) != 1 or pool.stride(1) != 1:
        raise ValueError("sparse_sink_attention: q and pool need a contiguous last axis")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"sparse_sink_attention: out must be {q.dtype} {tuple(q.shape)} with "
                         f"a contiguous last axis, got {out.dtype} {tuple(out.shape)}")
    if lens is not None and (lens.shape != (q.shape[0],)
                             or lens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"sparse_sink_attention: lens must be int32/int64 [{q.shape[0]}], "
                         f"got {lens.dtype} {tuple(lens.shape)}")


def sparse_sink_attention(q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor,
                          valid: torch.Tensor, sinks: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None, lens: torch.Tensor | None = None,
                          block_h: int = BLOCK_H,
                          block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                          num_stages: int = NUM_STAGES) -> torch.Tensor:
    """See the module docstring -> o [T, H, D] in q's dtype (`out` when given). The tile
    sizes and launch options are for the benchmark's sweeps; tiles must be powers of two
    >= 16."""
    _check_inputs(q, pool, idx, valid, sinks, out, lens)
    if triton is None:
        raise RuntimeError("sparse_sink_attention needs Triton (on CUDA or its interpreter)")
    T, H, D = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    sinks = sinks.float().contiguous()
    mask = valid.view(torch.uint8)  # same bytes; Triton's bool pointers are awkward
    heads = max(16, min(block_h, triton.next_power_of_2(H)))
    grid = (T * triton.cdiv(H, heads),)
    _sparse_sink_kernel[grid](
        q, pool, idx, mask, lens if lens is not None else idx, sinks, out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), pool.stride(0), idx.stride(0), idx.stride(1),
        mask.stride(0), mask.stride(1), out.stride(0), out.stride(1), H, D, idx.shape[1],
        BLOCK_H=heads, BLOCK_N=block_n, D_PAD=max(16, triton.next_power_of_2(D)),
        HAS_LENS=lens is not None, FP32_DOT=fp32_dots(q.dtype), num_warps=num_warps,
        num_stages=num_stages)
    return out


def fp32_dots(dtype: torch.dtype) -> bool:
    """float32 inputs take IEEE fp32 dots. So do 16-bit ones in Triton's interpreter, whose
    tl.dot returns garbage on bf16 operands (3.9): the same 16-bit values, exact products."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    # S and the row strides of idx/valid (S when contiguous) change every block; the unit
    # key strides stay specialized (1 in prefill: contiguous index loads)
    @triton.jit(do_not_specialize=["idx_st", "val_st", "S"])
    def _sparse_sink_kernel(q_ptr, pool_ptr, idx_ptr, val_ptr, len_ptr, sink_ptr, o_ptr,
                            scale_log2,
                            q_st, q_sh, pool_sm, idx_st, idx_ss, val_st, val_ss, o_st, o_sh,
                            H, D, S, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                            D_PAD: tl.constexpr, HAS_LENS: tl.constexpr,
                            FP32_DOT: tl.constexpr):
        head_blocks = tl.cdiv(H, BLOCK_H)
        pid = tl.program_id(0)
        t = (pid // head_blocks).to(tl.int64)
        h = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, D_PAD)
        h_ok, d_ok = h < H, d < D
        q = tl.load(q_ptr + t * q_st + h[:, None] * q_sh + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        # the sink opens the online softmax: max = sink, sum = exp2(sink - max) = 1
        m = tl.load(sink_ptr + h, mask=h_ok, other=0.0) * 1.4426950408889634
        total = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, D_PAD], dtype=tl.float32)
        keys = S
        if HAS_LENS:
            keys = tl.minimum(tl.load(len_ptr + t).to(tl.int32), S)
        for n0 in range(0, keys, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < keys
            ok = (tl.load(val_ptr + t * val_st + n * val_ss, mask=n_ok, other=0) != 0) & n_ok
            rows = tl.load(idx_ptr + t * idx_st + n * idx_ss, mask=ok, other=0).to(tl.int64)
            k = tl.load(pool_ptr + rows[:, None] * pool_sm + d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            if FP32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                           input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))  # 16-bit tensor cores, fp32 accumulate
            s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: m starts at the sink
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                pv = tl.dot(p.to(k.dtype).to(tl.float32), k.to(tl.float32),
                            input_precision="ieee")
            else:
                pv = tl.dot(p.to(k.dtype), k)
            acc = acc * alpha[:, None] + pv
            m = m_new
        o = acc / total[:, None]
        tl.store(o_ptr + t * o_st + h[:, None] * o_sh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
