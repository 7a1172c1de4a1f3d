"""DeepSeek-V4's lightning indexer for a block of prefill rows as one Triton kernel, without
the [T, h, C] fp32 dot products the torch path materializes, and its top-k.

    indexer_scores(q_ThD, keys_CD, w_Th, scale, bounds=None) -> scores_TC
    indexer_topk(q_ThD, keys_CD, w_Th, scale, bounds, k) -> picks_Tk
    topk_as_reference(scores_TC, first_T, length_T, k) -> picks_Tk   (torch, any device)

scores[t, c] = scale * sum_h w[t, h] * relu(q[t, h] . keys[c]), in fp32; with bounds =
(lo_T, hi_T), -inf where c is outside [lo[t], hi[t]) (the entries row t may see: those of
its own sequence whose window has closed). `indexer_topk` -> the k best entries of each row,
best first, equal scores to the lower entry (what a stable descending sort of the scores
picks), -1 where the pick is not visible.

Legend: T query rows, h index heads, D index head dim, C keys (the block's CSA entries).

Inputs: q [T, h, D] and keys [C, D] of one dtype (bf16/fp16 on the GPU; float32 runs with
IEEE fp32 dots, for the interpreter tests), last dims contiguous, other strides free; w
[T, h] float32, already scaled by h^-0.5 (`DeepseekV4IndexerScorer`); lo, hi [T] int64.

Kernel: one program per (block of BLOCK_T rows, block of BLOCK_C keys), the key blocks of a
row block adjacent in launch order so they share its q rows in L2. A tile no row of the block
may see is written without computing. Else it loads its [BLOCK_C, D] key tile once and walks
the h heads: a tl.dot of the rows' q of head h [BLOCK_T, D] with the key tile (16-bit tensor
cores, fp32 accumulation), relu, times w[rows, h], summed into a [BLOCK_T, BLOCK_C] fp32
tile; times scale, masked, stored. Per head the sum adds one fp32 rounding where the torch
path summed the heads of an fp32 [T, h, C] tensor: the same math, another order.

Top-k: the kernel writes, instead of the score, an int64 key whose order is the stable
descending sort's: the score's bits mapped to an order-preserving int32 in the high half, and
0xFFFFFFFF - c in the low half (equal scores: the lower entry is the larger key). Keys are
unique, so `torch.topk` over them is deterministic and picks what the sort picks, without
sorting every row (at 64K tokens the stable sort of the scores took 101 ms of a 622 ms
prefill on the H200; a top-k over int64 keys about half as long per row, bench/results
topk-probe-*.log).

T, C and the row strides of the output (C) change every block and are not specialized on,
so a prefill compiles one variant per dtype and config, not one per new residue mod 16.

Ties in float32 (`topk_as_reference`): the reference (transformers' `DeepseekV4Indexer`)
takes `torch.topk` of one row per query: its sequence's entries so far, in entry order, the
ones the query may not see yet at -inf. A score is exactly 0 wherever every head's q.k is
<= 0 (relu), so with few index heads many entries tie, and which tied entries `topk` picks
depends on the whole row, its length included (on CPU a partial sort or an introselect).
The float32 path therefore builds each query's row exactly as the reference does and calls
`torch.topk` on it, so it picks what the reference picks in every batch composition and CP
layout: the rows of one length go through one call, and each row holds the same values
whatever else shares the call. The 16-bit kernel path keeps its own rule (equal scores to the
lower entry), being compared with float32 by tolerance, not pick by pick.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpmoe._triton import import_triton
from cpmoe.models.deepseek_v4.sparse import fp32_dots

triton, tl = import_triton()

# Defaults for D = 128, h = 64 on an H100/H200, chosen by size, not swept (`python3 -m
# bench.v4_indexer --sweep` times the alternatives; at them the kernel ran at 349-418
# TFLOP/s on the H200, bench/results/v4-indexer-eafae3c.log): a [64, 128] fp32 accumulator (32
# registers a thread at 8 warps, as much again for a head's dot), a [128, 128] bf16 key
# tile (32 KB) and a [64, 128] bf16 q tile (16 KB) a stage.
BLOCK_T, BLOCK_C, NUM_WARPS, NUM_STAGES = 64, 128, 8, 2


def _order_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 bits of fp32 values -> int32 in the values' order (negative values' magnitude
    bits flipped): the kernel's mapping, here for -inf's key."""
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


# the high half of an entry's key when its score is -inf: not visible to the row
_HIDDEN = int(_order_bits(torch.tensor([float("-inf")]).view(torch.int32))[0])


_LOW = 0xFFFFFFFF


def order_keys(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 scores and int64 entry ids (< 2^32) -> int64 keys in the order of a stable
    descending sort by score, then id: the score's order-preserving bits above, 2^32-1 - id
    below (the kernel's keys, in torch). -0.0 counts as 0.0, as the sort compares them.
    Keys are unique where ids are, so `torch.topk` of them picks what the sort picks."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores).float().contiguous()
    high = _order_bits(s.view(torch.int32)).to(torch.int64) << 32
    return high | (_LOW - ids)


def keys_to_ids(top: torch.Tensor) -> torch.Tensor:
    """`order_keys` picks -> their entry ids, -1 where the score was -inf (not visible)."""
    return torch.where((top >> 32) > _HIDDEN, _LOW - (top & _LOW), -1)


def top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest keys of each row, largest first, rows of fewer than k padded with the
    key of a hidden entry (no sort: `torch.topk`)."""
    if keys.shape[-1] < k:
        keys = F.pad(keys, (0, k - keys.shape[-1]), value=(_HIDDEN << 32) | 0)
    return keys.topk(k, dim=-1).values


def _check_inputs(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                  bounds: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Shape/dtype/layout checks only (no value is read, so no host sync)."""
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"indexer_scores: need q [T, h, D] and keys [C, D], got "
                         f"{tuple(q.shape)} and {tuple(keys.shape)}")
    if keys.dtype != q.dtype:
        raise ValueError(f"indexer_scores: need keys in q's dtype {q.dtype}, got {keys.dtype}")
    if w.shape != q.shape[:2] or w.dtype != torch.float32:
        raise ValueError(f"indexer_scores: need w float32 {tuple(q.shape[:2])}, got "
                         f"{w.dtype} {tuple(w.shape)}")
    if bounds is not None and any(b.shape != q.shape[:1] or b.dtype != torch.int64
                                  for b in bounds):
        raise ValueError(f"indexer_scores: need bounds (lo, hi) int64 [{q.shape[0]}], got "
                         f"{[(b.dtype, tuple(b.shape)) for b in bounds]}")
    if q.stride(2) != 1 or keys.stride(1) != 1:
        raise ValueError("indexer_scores: q and keys need a contiguous last axis")


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, scale: float,
                   bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                   block_t: int = BLOCK_T, block_c: int = BLOCK_C, num_warps: int = NUM_WARPS,
                   num_stages: int = NUM_STAGES, order_keys: bool = False) -> torch.Tensor:
    """See the module docstring -> scores [T, C] float32 (order_keys: the int64 keys). The
    tile sizes and launch options are for the benchmark's sweeps; tiles must be powers of
    two >= 16 (tl.dot's minimum)."""
    _check_inputs(q, keys, w, bounds)
    if triton is None:
        raise RuntimeError("indexer_scores needs Triton (on CUDA or its interpreter)")
    (T, H, D), C = q.shape, keys.shape[0]
    out = torch.empty(T, C, dtype=torch.int64 if order_keys else torch.float32,
                      device=q.device)
    if T == 0 or C == 0:
        return out
    lo, hi = bounds if bounds is not None else (out, out)  # any pointers when not MASKED
    grid = (triton.cdiv(T, block_t) * triton.cdiv(C, block_c),)
    _indexer_kernel[grid](
        q, keys, w, lo, hi, out, scale, q.stride(0), q.stride(1), keys.stride(0), w.stride(0),
        w.stride(1), out.stride(0), T, C, H, D, BLOCK_T=block_t, BLOCK_C=block_c,
        D_PAD=max(16, triton.next_power_of_2(D)), MASKED=bounds is not None,
        KEYS=order_keys, FP32_DOT=fp32_dots(q.dtype), num_warps=num_warps,
        num_stages=num_stages)
    return out


def indexer_topk(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, scale: float,
                 bounds: tuple[torch.Tensor, torch.Tensor], k: int) -> torch.Tensor:
    """See the module docstring -> picks [T, min(k, C)] int64, best first, -1 where not
    visible."""
    order = indexer_scores(q, keys, w, scale, bounds, order_keys=True)
    return keys_to_ids(order.topk(min(k, order.shape[1]), dim=-1).values)


def topk_as_reference(scores_TC: torch.Tensor, first_T: torch.Tensor,
                      length_T: torch.Tensor, k: int) -> torch.Tensor:
    """Row t's reference row is scores[t, first[t] : first[t] + length[t]] (its sequence's
    entries in the reference forward, not-yet-visible ones at -inf; columns past C count as
    -inf, so scores need only reach the last visible entry) -> [T, k] picks into scores'
    columns: `torch.topk` of that row, min(k, length) of them, -1 past those and where the
    pick is -inf (not visible). Host syncs: the lengths."""
    (T, C), dev = scores_TC.shape, scores_TC.device
    picks = torch.full((T, k), -1, dtype=torch.int64, device=dev)
    lengths = length_T.tolist()
    need = int((first_T + length_T).max()) if T else 0
    if need > C:
        scores_TC = F.pad(scores_TC, (0, need - C), value=float("-inf"))
    for n in sorted(set(lengths) - {0}):
        rows = torch.tensor([t for t, m in enumerate(lengths) if m == n], device=dev)
        cols = first_T[rows, None] + torch.arange(n, device=dev)
        row = scores_TC[rows[:, None], cols]  # [r, n], contiguous like the reference's row
        best = row.topk(min(k, n), dim=-1)
        got = torch.where(best.values > float("-inf"), cols.gather(1, best.indices), -1)
        picks[rows, :got.shape[1]] = got
    return picks


class ReferenceTopK(torch.nn.Module):
    """`topk_as_reference` as a module of each CSA indexer (no parameters), so an observer
    can hook its calls as it hooks a router's (`cpmoe check` measures the margins at the
    top-k cut). forward(scores_TC, first_T, length_T, k, rows_T) -> picks [T, k]; rows_T:
    the rows' indices among the forward's local rows (prefill blocks are slices of them)."""

    def forward(self, scores_TC: torch.Tensor, first_T: torch.Tensor, length_T: torch.Tensor,
                k: int, rows_T: torch.Tensor) -> torch.Tensor:
        return topk_as_reference(scores_TC, first_T, length_T, k)


if triton is not None:
    # T, C and the row stride of the output (C when contiguous) change every block
    @triton.jit(do_not_specialize=["o_st", "T", "C"])
    def _indexer_kernel(q_ptr, k_ptr, w_ptr, lo_ptr, hi_ptr, o_ptr, scale, q_st, q_sh, k_sc,
                        w_st, w_sh, o_st, T, C, H, D, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr, D_PAD: tl.constexpr, MASKED: tl.constexpr,
                        KEYS: tl.constexpr, FP32_DOT: tl.constexpr):
        c_blocks = tl.cdiv(C, BLOCK_C)
        pid = tl.program_id(0)
        t = (pid // c_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        c0 = (pid % c_blocks) * BLOCK_C
        c = c0 + tl.arange(0, BLOCK_C)
        d = tl.arange(0, D_PAD)
        t_ok, c_ok, d_ok = t < T, c < C, d < D
        t64 = t.to(tl.int64)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        seen = t_ok[:, None] & c_ok[None, :]
        if MASKED:
            lo = tl.load(lo_ptr + t64, mask=t_ok, other=0)
            hi = tl.load(hi_ptr + t64, mask=t_ok, other=0)
            seen = seen & (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
        if tl.max(seen.to(tl.int32)) > 0:  # else no row of the block may see the tile
            k = tl.load(k_ptr + c.to(tl.int64)[:, None] * k_sc + d[None, :],
                        mask=c_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_C, D_PAD]
            if FP32_DOT:
                k_t = tl.trans(k.to(tl.float32))
            else:
                k_t = tl.trans(k)
            q_rows = q_ptr + t64[:, None] * q_st + d[None, :]
            q_ok = t_ok[:, None] & d_ok[None, :]
            for h in range(0, H):
                qh = tl.load(q_rows + h * q_sh, mask=q_ok, other=0.0)  # [BLOCK_T, D_PAD]
                if FP32_DOT:
                    s = tl.dot(qh.to(tl.float32), k_t, input_precision="ieee")
                else:
                    s = tl.dot(qh, k_t)  # 16-bit tensor cores, fp32 accumulate
                wh = tl.load(w_ptr + t64 * w_st + h * w_sh, mask=t_ok, other=0.0)
                acc += tl.maximum(s, 0.0) * wh[:, None]
        acc = acc * scale
        acc = tl.where(acc == 0.0, 0.0, acc)  # a -0.0 becomes 0.0: one key for equal scores
        if MASKED:
            acc = tl.where(seen, acc, float("-inf"))
        tile = t64[:, None] * o_st + c[None, :]
        ok = t_ok[:, None] & c_ok[None, :]
        if KEYS:
            bits = acc.to(tl.int32, bitcast=True)
            bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            key = (bits.to(tl.int64) << 32) | (4294967295 - c.to(tl.int64))[None, :]
            tl.store(o_ptr + tile, key, mask=ok)
        else:
            tl.store(o_ptr + tile, acc, mask=ok)
