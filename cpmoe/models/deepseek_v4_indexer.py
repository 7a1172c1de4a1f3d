"""DeepSeek-V4's lightning-indexer scores for a block of prefill rows as one Triton kernel,
without the [T, h, C] fp32 dot products the torch path materializes.

    indexer_scores(q_ThD, keys_CD, w_Th, scale, visible_TC=None) -> scores_TC

scores[t, c] = scale * sum_h w[t, h] * relu(q[t, h] . keys[c]), in fp32; -inf where
visible[t, c] is False when a mask is given (what `select_visible` sorts).

Legend: T query rows, h index heads, D index head dim, C keys (the block's CSA entries).

Inputs: q [T, h, D] and keys [C, D] of one dtype (bf16/fp16 on the GPU; float32 runs with
IEEE fp32 dots, for the interpreter tests), last dims contiguous, other strides free; w
[T, h] float32, already scaled by h^-0.5 (`DeepseekV4IndexerScorer`); visible [T, C] bool,
last dim contiguous. Output: a new contiguous [T, C] float32 tensor.

Kernel: one program per (block of BLOCK_T rows, block of BLOCK_C keys), the key blocks of a
row block adjacent in launch order so they share its q rows in L2. It loads its [BLOCK_C, D]
key tile once and walks the h heads: a tl.dot of the rows' q of head h [BLOCK_T, D] with the
key tile (16-bit tensor cores, fp32 accumulation), relu, times w[rows, h], summed into a
[BLOCK_T, BLOCK_C] fp32 tile; times scale, masked, stored. Per head the sum adds one fp32
rounding where the torch path summed the heads of an fp32 [T, h, C] tensor: the same math,
another order.

T, C and the row strides of the mask and output (C) change every block and are not
specialized on, so a prefill compiles one variant per dtype and config, not one per new
residue mod 16.
"""

from __future__ import annotations

import torch

from cpmoe._triton import import_triton
from cpmoe.models.deepseek_v4_sparse import fp32_dots

triton, tl = import_triton()

# Defaults for D = 128, h = 64 on an H100/H200, chosen by size, not swept (`python3 -m
# bench.v4_indexer --sweep` times the alternatives; at them the kernel ran at 349-418
# TFLOP/s on the H200, bench/results/v4-indexer-eafae3c.log): a [64, 128] fp32 accumulator (32
# registers a thread at 8 warps, as much again for a head's dot), a [128, 128] bf16 key
# tile (32 KB) and a [64, 128] bf16 q tile (16 KB) a stage.
BLOCK_T, BLOCK_C, NUM_WARPS, NUM_STAGES = 64, 128, 8, 2


def _check_inputs(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                  visible: torch.Tensor | None) -> None:
    """Shape/dtype/layout checks only (no value is read, so no host sync)."""
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"indexer_scores: need q [T, h, D] and keys [C, D], got "
                         f"{tuple(q.shape)} and {tuple(keys.shape)}")
    if keys.dtype != q.dtype:
        raise ValueError(f"indexer_scores: need keys in q's dtype {q.dtype}, got {keys.dtype}")
    if w.shape != q.shape[:2] or w.dtype != torch.float32:
        raise ValueError(f"indexer_scores: need w float32 {tuple(q.shape[:2])}, got "
                         f"{w.dtype} {tuple(w.shape)}")
    want = (q.shape[0], keys.shape[0])
    if visible is not None and (visible.shape != want or visible.dtype != torch.bool):
        raise ValueError(f"indexer_scores: need visible bool {want}, got {visible.dtype} "
                         f"{tuple(visible.shape)}")
    if q.stride(2) != 1 or keys.stride(1) != 1 or (visible is not None
                                                    and visible.stride(1) != 1):
        raise ValueError("indexer_scores: q, keys and visible need a contiguous last axis")


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, scale: float,
                   visible: torch.Tensor | None = None, block_t: int = BLOCK_T,
                   block_c: int = BLOCK_C, num_warps: int = NUM_WARPS,
                   num_stages: int = NUM_STAGES) -> torch.Tensor:
    """See the module docstring -> scores [T, C] float32. The tile sizes and launch options
    are for the benchmark's sweeps; tiles must be powers of two >= 16 (tl.dot's minimum)."""
    _check_inputs(q, keys, w, visible)
    if triton is None:
        raise RuntimeError("indexer_scores needs Triton (on CUDA or its interpreter)")
    (T, H, D), C = q.shape, keys.shape[0]
    out = torch.empty(T, C, dtype=torch.float32, device=q.device)
    if T == 0 or C == 0:
        return out
    mask = out if visible is None else visible.view(torch.uint8)  # Triton's bools: awkward
    grid = (triton.cdiv(T, block_t) * triton.cdiv(C, block_c),)
    _indexer_kernel[grid](
        q, keys, w, mask, out, scale, q.stride(0), q.stride(1), keys.stride(0), w.stride(0),
        w.stride(1), mask.stride(0), out.stride(0), T, C, H, D, BLOCK_T=block_t,
        BLOCK_C=block_c, D_PAD=max(16, triton.next_power_of_2(D)),
        MASKED=visible is not None, FP32_DOT=fp32_dots(q.dtype), num_warps=num_warps,
        num_stages=num_stages)
    return out


if triton is not None:
    # T, C and the row strides of the mask and output (C when contiguous) change every block
    @triton.jit(do_not_specialize=["vis_st", "o_st", "T", "C"])
    def _indexer_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, o_ptr, scale, q_st, q_sh, k_sc, w_st,
                        w_sh, vis_st, o_st, T, C, H, D, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr,
                        FP32_DOT: tl.constexpr):
        c_blocks = tl.cdiv(C, BLOCK_C)
        pid = tl.program_id(0)
        t = (pid // c_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = (pid % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        d = tl.arange(0, D_PAD)
        t_ok, c_ok, d_ok = t < T, c < C, d < D
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + c.to(tl.int64)[:, None] * k_sc + d[None, :],
                    mask=c_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_C, D_PAD]
        if FP32_DOT:
            k_t = tl.trans(k.to(tl.float32))
        else:
            k_t = tl.trans(k)
        q_rows = q_ptr + t64[:, None] * q_st + d[None, :]
        q_ok = t_ok[:, None] & d_ok[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for h in range(0, H):
            qh = tl.load(q_rows + h * q_sh, mask=q_ok, other=0.0)  # [BLOCK_T, D_PAD]
            if FP32_DOT:
                s = tl.dot(qh.to(tl.float32), k_t, input_precision="ieee")
            else:
                s = tl.dot(qh, k_t)  # 16-bit tensor cores, fp32 accumulate
            wh = tl.load(w_ptr + t64 * w_st + h * w_sh, mask=t_ok, other=0.0)
            acc += tl.maximum(s, 0.0) * wh[:, None]
        acc = acc * scale
        tile = t64[:, None] * o_st + c[None, :]
        ok = t_ok[:, None] & c_ok[None, :]
        if MASKED:
            seen = tl.load(vis_ptr + t64[:, None] * vis_st + c[None, :], mask=ok, other=0)
            acc = tl.where(seen != 0, acc, float("-inf"))
        tl.store(o_ptr + tile, acc, mask=ok)
