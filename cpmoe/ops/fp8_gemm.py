"""FP8 compute: block-scaled GEMMs (activations quantized by `fp8.quantize_act`).

- `fp8_linear(x, w, w_scale, block, bias)`: y = x W^T with W = w * w_scale per [bn, bk]
  block. On CUDA with [128, 128] blocks it is `fp8_linear_skinny` for few rows, else
  `F.scaled_mm` with the BlockWise1x128 / BlockWise128x128 recipes (checked on the H200);
  other blocks use the Triton grouped kernel below with one group.
- `fp8_linear_skinny(xq, x_scale, w, w_scale, bias)`: the same product for few rows
  (decode) quantized by `quantize_act`, one Triton launch (two with a split K);
  `fp8_linear` takes it for up to SKINNY_ROWS rows with [128, 128] blocks.
- `grouped_fp8_gemm(a, a_scale, w, w_scale, offs, block)`: rows [P, K] sorted by expert
  (expert e owns rows [offs[e-1], offs[e])), experts' weights w [E, N, K] with scales
  [E, N/bn, K/bk] -> [P, N] in bfloat16 (rows past offs[-1] are zero). Triton, one
  program per (row tile of one expert, column tile); the tile -> expert map is computed on
  the device by one small kernel (`grouped_fp8_tiles`: no host sync, so CUDA graphs can
  capture it; the experts' two GEMMs share it). Tiles are loaded by per-element
  addresses or through TMA descriptors (`TMA_MODES`, per config); `a_rows` has the kernel
  read each sorted row from unsorted rows itself (the experts' tokens, no gathered copy).
  `torch._scaled_grouped_mm` is row-wise only, hence this kernel.

Kernels accumulate in float32: per K-block, the FP8 dot product is scaled by the row's
activation scale and the weight block's scale (the grouped GEMM rescales its running sum
into each block's scale instead, `_grouped_fp8_kernel`). `*_ref` are the torch expressions
the kernels are tested against. Requires bk == activation group size, and K a multiple of bk.
"""

from __future__ import annotations

import os
import warnings

import torch

from cpmoe.ops import launch
from cpmoe.ops.fp8 import FP8, dequantize, quantize_act, quantize_act_ref
from cpmoe.ops.launch import pdl_args, tl, triton

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter: FP8 dots upcast
if triton is not None:
    from cpmoe.ops.launch import wait_for_producer


# ---- block-scaled grouped GEMM ----------------------------------------------------------

def grouped_fp8_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                         w_scale: torch.Tensor, offs: torch.Tensor, block: tuple[int, int],
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize both sides and multiply in float32, expert by expert."""
    P, K = a.shape
    x = dequantize(a, a_scale, (1, block[1]))
    out = torch.zeros(P, w.shape[1], dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ dequantize(w[e], w_scale[e], block).t()
        start = end
    return out.to(out_dtype)


def grouped_fp8_config(P: int, E: int, a_rows: bool = False, swiglu: bool = False,
                       after_swiglu: bool = False) -> dict:
    """Tiles of `grouped_fp8_gemm` for P rows over E experts: BM rows x BN columns (weight
    scales are read per column, so tiles need not align with the scale blocks), the
    launch's warps and pipeline stages, and how tiles are loaded (TMA, `TMA_MODES`);
    a_rows: the rows are read through `a_rows` (the experts' gate/up GEMM reads each slot's
    token row so). 128-column tiles of 128 x 128 blocks read one weight scale. Swept on an
    H100 at Qwen3-30B-A3B's expert shape (bench/fp8_grouped.py, 4K and 16K tokens x top-8,
    at b24c38e; bench/results/fp8-grouped-tma-b24c38e.log): 64 x 128 tiles with 3 stages,
    rows and weights through TMA, for down (16K: 0.692 ms against 0.873 for the address
    loads with 4 stages, the choice of 1db9310's H200 sweep; 4K: 0.201 against 0.244) and
    the address loads with a_rows for gate/up (16K: 1.306 ms, where TMA needs a gathered
    copy: 1.209 + its gather 0.184; the old default 1.234 + 0.184). Within 5% of the
    fastest each GEMM alone took then (run-to-run spread of a config about 5%). Experts of
    a few rows each keep 16-row tiles and address loads (not swept with TMA). swiglu
    (gate/up with its SwiGLU, address loads):
    64 output columns a tile, 64 of gate and 64 of up, the MMA work of a 128-column tile
    (in the model a 16K FP8 prefill on an H100 took 0.277 s against 0.281 for the unfused
    GEMM and swiglu_quantize, bench/results/fp8-swiglu-568040c.log). From 128 rows an
    expert on average, the SwiGLU gate/up and the down GEMM after it (`after_swiglu`; the
    two share one tile map, so one BM) take 128-row tiles: gate/up 128 columns of gate and
    128 of up on 8 warps, down 128 x 64 through TMA. Swept on an H100 at b34d70d
    (bench/results/fp8-grouped-bm128-h100-b34d70d.log, equal bits): gate/up 1.133 / 0.627 /
    0.387 ms at 16K / 8K / 4K tokens against 1.299 / 0.690 / 0.414 for 64 x 64 tiles,
    down 0.618 / 0.348 / 0.231 against 0.644 / 0.361 / 0.232; a 16K FP8 prefill 0.273 s
    against 0.281 (bench/results/fp8-h100-b34d70d.log). Since the kernel keeps one
    accumulator a product (rescaled block to block, `_grouped_fp8_kernel`), gate/up takes 4
    stages and down 128 x 128 tiles on 4 warps (which spilled before): at 16K tokens on an
    H100 at 9e4dde1 gate/up 1.041 ms against 1.076 with 3 stages (1.175 before the rescaling),
    down 0.629 against 0.679 for 128 x 64 (0.669 before;
    bench/results/fp8-grouped-rescale-h100-9e4dde1.log.gz). Below 4K tokens, for the unfused
    gate/up and at other models' expert shapes (DeepSeek-V4's), not swept."""
    if P <= 16 * E:
        return {"BM": 16, "BN": 64 if swiglu else 128, "num_warps": 4, "num_stages": 4,
                "TMA": ""}
    if P >= 128 * E and swiglu:
        return {"BM": 128, "BN": 128, "num_warps": 8, "num_stages": 4, "TMA": ""}
    if P >= 128 * E and after_swiglu:
        return {"BM": 128, "BN": 128, "num_warps": 4, "num_stages": 3, "TMA": "aw"}
    return {"BM": 64, "BN": 64 if swiglu else 128, "num_warps": 4, "num_stages": 3,
            "TMA": "" if a_rows or swiglu else "aw"}


def grouped_fp8_tiles(offs: torch.Tensor, P: int, E: int, BM: int) -> torch.Tensor:
    """The tile slots of `grouped_fp8_gemm` over P rows sorted by E experts (expert e's end
    offs[e]) in BM-row tiles -> int32 [2, slots]: each slot's expert (E: a spare slot) and
    first row. One Triton launch (the seven torch ops it replaces were host work that a
    short prefill's step waited on: at 1K tokens FP8 steps were host-bound,
    bench/results/fp8-prefill-1k-c7c02fd.log); the experts' two GEMMs share it.

    Enough slots for the experts' tiles and the zero tail, for any routing: with n_e rows
    for expert e and L = offs[-1] = sum n_e <= P, the experts take
    T = sum ceil(n_e / BM) <= sum (n_e + BM - 1) / BM = (L + E (BM - 1)) / BM slots, so the
    spare ones, slots = ceil(P / BM) + E, number slots - T >= P / BM + E - L / BM - E +
    E / BM > (P - L) / BM, an integer, hence >= ceil((P - L) / BM): the tiles of the tail
    rows [L, P), the (t - T)-th starting at row L + (t - T) BM."""
    slots = _tile_slots(P, E, BM)
    tile_map = torch.empty(2, slots, dtype=torch.int32, device=offs.device)
    _tile_map_kernel[(triton.cdiv(slots, _MAP_BLOCK),)](
        offs.contiguous(), tile_map, slots, E=E, E_POW2=triton.next_power_of_2(E), BM=BM,
        BLOCK=_MAP_BLOCK, num_warps=4)
    return tile_map


def _tile_slots(P: int, E: int, BM: int) -> int:
    return (P + BM - 1) // BM + E  # see grouped_fp8_tiles


_MAP_BLOCK = 64  # tile slots a program of `_tile_map_kernel`: [64, E] comparisons


def grouped_fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, offs: torch.Tensor, block: tuple[int, int],
                     out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None,
                     tiles: torch.Tensor | None = None, a_rows: torch.Tensor | None = None,
                     swiglu: bool = False, limit: float | None = None) -> torch.Tensor:
    """config: `grouped_fp8_config`'s keys (bench/fp8_grouped.py sweeps them). tiles:
    `grouped_fp8_tiles(offs, P, E, config's BM)` made ahead (else made here). a_rows: the
    sorted rows are a's rows a_rows [P] (and a_scale's), read where the kernel loads them,
    instead of a gathered copy (a then has any number of rows). swiglu: w holds gate rows
    then up rows [E, 2I, K] and the result is their SwiGLU [P, I] (with limit: the clamped
    one, `activation.swiglu_act`), each program multiplying a column tile of gate and the
    same of up: gate and up are rounded to out_dtype first, the SwiGLU after, as the
    unfused GEMM and `fp8.swiglu_quantize` round them (address loads only)."""
    P, K = a.shape if a_rows is None else (a_rows.shape[0], a.shape[1])
    E, N, _ = w.shape
    if swiglu:
        N //= 2
    bn, bk = block
    if K % bk or bk < 16 or bk & (bk - 1):
        raise ValueError(f"grouped FP8 GEMM: K {K} must be a multiple of the block {bk}, a "
                         f"power of two >= 16")
    # uninitialized: the kernel writes every row, the tail past offs[-1] as zeros (a
    # zero-filled [P, N] buffer cost ~0.5 GB of writes a layer at 16K tokens)
    out = torch.empty(P, N, dtype=out_dtype, device=a.device)
    if P == 0:
        return out
    cfg = config or grouped_fp8_config(P, E, swiglu=swiglu)
    BM, BN, BK = cfg["BM"], cfg["BN"], bk
    if swiglu and (cfg.get("TMA", "") or N % bn or bn % BN):
        raise ValueError(f"grouped FP8 GEMM with SwiGLU: address loads (TMA '') and column "
                         f"tiles inside one scale block of {bn} rows of gate and of up "
                         f"(I = {N}), got TMA {cfg.get('TMA')!r} and BN {BN}")
    tile_map = tiles if tiles is not None else grouped_fp8_tiles(offs, P, E, BM)
    if tuple(tile_map.shape) != (2, _tile_slots(P, E, BM)):
        raise ValueError(f"grouped FP8 GEMM: a tile map of {tuple(tile_map.shape)} for "
                         f"{P} rows, {E} experts and {BM}-row tiles (grouped_fp8_tiles)")
    # one program per (row tile, column tile), column tiles fastest: the programs that run
    # together share their rows, which L2 then serves once for all of a row tile's columns
    # (row tiles fastest read all the rows again for every column tile: 12 times a layer's
    # 268 MB at 16K tokens for gate/up)
    grid = (tile_map.shape[1] * triton.cdiv(N, BN),)
    tma = cfg.get("TMA", "")
    if tma not in TMA_MODES:
        raise ValueError(f"grouped FP8 GEMM: config TMA {tma!r}, expected one of {TMA_MODES}")
    if a_rows is not None and "a" in tma:  # TMA copies boxes of consecutive rows
        a, a_scale, a_rows = a[a_rows], a_scale[a_rows], None
    a = a if a.stride(1) == 1 and a.stride(0) == K else a.contiguous()
    if not w.is_contiguous():  # the experts' weights: copying them every call would be slow
        raise ValueError(f"grouped FP8 GEMM: the weights must be contiguous [E, N, K], got "
                         f"strides {w.stride()} for shape {tuple(w.shape)}")
    a_in = tma_descriptor(a, BM, BK) if "a" in tma else a
    w_in = tma_descriptor(w.view(E * N, K), BN, BK) if "w" in tma else w
    rows = a_rows if a_rows is not None else offs  # any pointer when not GATHER
    _grouped_fp8_kernel[grid](
        a_in, a_scale, w_in, w_scale, out, offs.contiguous(), tile_map, rows, P, N, K,
        a_scale.stride(0), a_scale.stride(1), w_scale.stride(0), w_scale.stride(1),
        w_scale.stride(2), 0.0 if limit is None else float(limit), E=E, BN_Q=bn, BM=BM,
        BN=BN, BK=BK, UPCAST=_INTERPRET, TMA_A="a" in tma, TMA_W="w" in tma,
        GATHER=a_rows is not None, SWIGLU=swiglu, CLAMP=limit is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# How the grouped GEMM loads its tiles: "" by per-element addresses (cp.async), "w" the
# weights through TMA descriptors, "aw" the rows too (then rows given as a_rows are gathered
# into a copy first: a TMA box is consecutive rows)
TMA_MODES = ("", "w", "aw")


def tma_descriptor(x: torch.Tensor, rows: int, cols: int):
    """A TMA descriptor of the matrix x [R, C] in rows x cols boxes; the experts' weights are
    one [E N, K] matrix, so a tile's box past its expert's columns (or a row box past its
    expert's rows) holds the next expert's, which the store masks; past R, zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [rows, cols])


if triton is not None:
    from cpmoe.ops.activation import swiglu_act

    _TINY_SCALE = tl.constexpr(1e-20)

    @triton.jit
    def _rescaled_dot(a, b, acc, c_acc, a_s, w_s):
        """acc (in units of its rows' scale c_acc) plus a . b times the block's scales a_s
        (rows) and w_s (one a tile) -> (the sum in units of c = max(a_s * w_s, _TINY_SCALE),
        c): acc is rescaled to c and the MMA accumulates into it."""
        c = tl.maximum(a_s * w_s, _TINY_SCALE)
        return tl.dot(a, b, acc * (c_acc / c)[:, None]), c

    @triton.jit(do_not_specialize=["slots"])
    def _tile_map_kernel(offs_ptr, map_ptr, slots, E: tl.constexpr, E_POW2: tl.constexpr,
                         BM: tl.constexpr, BLOCK: tl.constexpr):
        """Slots [BLOCK * pid, ..): map[0] = the first expert whose tiles end past the slot
        (E: none), map[1] = the slot's first row (`grouped_fp8_tiles`)."""
        idx = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + idx, mask=idx < E, other=0).to(tl.int32)
        starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0).to(tl.int32)
        tiles = (ends - starts + BM - 1) // BM  # lanes past E: 0
        tile_end = tl.cumsum(tiles, 0)
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        e = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), 1)
        mine = idx[None, :] == e[:, None]
        first = tl.sum(tl.where(mine, (tile_end - tiles)[None, :], 0), 1)
        start = tl.sum(tl.where(mine, starts[None, :], 0), 1)
        spare_row = tl.max(ends, 0) + (t - tl.sum(tiles, 0)) * BM
        row = tl.where(e < E, start + (t - first) * BM, spare_row)
        tl.store(map_ptr + t, e, mask=t < slots)
        tl.store(map_ptr + slots + t, row, mask=t < slots)

    # P (the slots) and as_s1 (the row scales' column stride: the rows, `quantize_act`'s
    # layout) change every step: no variant per residue mod 16 (a served step of 8,191
    # tokens after steps of 8,192 compiled a new variant, 1.3 s, on an H200 at 1d2b62c)
    @triton.jit(do_not_specialize=["P", "as_s1"])
    def _grouped_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, offs_ptr, map_ptr,
                            rows_ptr, P, N, K, as_s0, as_s1, ws_s0, ws_s1, ws_s2, limit,
                            E: tl.constexpr, BN_Q: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
                            TMA_A: tl.constexpr = False, TMA_W: tl.constexpr = False,
                            GATHER: tl.constexpr = False, SWIGLU: tl.constexpr = False,
                            CLAMP: tl.constexpr = False):
        """TMA_A / TMA_W: a_ptr / w_ptr are `tma_descriptor`s (tiles copied by the TMA unit, no
        per-element addresses). GATHER: sorted row r is a's row rows_ptr[r]. SWIGLU: the
        expert's 2N weight rows are gate then up; the program's N columns of each, two dots
        a K block, give out [P, N] = swiglu_act(gate, up) (CLAMP: at limit), gate and up
        rounded to out's dtype first (address loads, one weight scale a tile).

        A tile inside one weight scale block (ONE_WS) keeps each row's sum in units of the
        current K block's scale c = a_s * w_s: acc <- dot(a, b, acc * c_prev / c), times the
        last c after the loop, so the MMA accumulates into acc itself. Scaling each block's
        product before adding it held a second accumulator the size of acc: compiled for
        sm_90 (Triton 3.9), gate/up with its SwiGLU at 128 x 128 on 8 warps took 255
        registers and spilled, 240 and no spill now; down at 128 x 128 on 4 warps 255 and a
        spill, 200 now. c is at least _TINY_SCALE: a weight block of scale 0 (or a masked
        row) adds 1e-20 of its product instead of dividing by 0; an all-zero activation
        group has the 1e-12 scale."""
        n_tiles = tl.cdiv(N, BN)
        t = tl.program_id(0) // n_tiles
        pid_n = tl.program_id(0) % n_tiles
        slots = tl.num_programs(0) // n_tiles
        e = tl.load(map_ptr + t)  # the slot's expert (E: a spare slot) and first row
        row0 = tl.load(map_ptr + slots + t)
        rows = row0 + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < N
        if e >= E:  # a spare slot: zeros past offs[-1]
            zero = tl.zeros((BM, BN), dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], zero,
                     mask=(rows < P)[:, None] & col_ok[None, :])
            return
        end = tl.load(offs_ptr + e)
        row_ok = rows < end
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        W_ROWS: tl.constexpr = 2 if SWIGLU else 1  # weight rows an output column: gate, up
        w_base = w_ptr if TMA_W else w_ptr + e.to(tl.int64) * W_ROWS * N * K
        src = tl.load(rows_ptr + rows, mask=row_ok, other=0) if GATHER else rows
        # The scales of K block kb are loaded one block ahead, before the dot: loaded after
        # it, their latency followed every MMA's wait (Triton pipelines the tile loads
        # only). A tile inside one weight scale block (BN divides BN_Q) reads one scale.
        ONE_WS: tl.constexpr = BN_Q % BN == 0
        as_rows = as_ptr + src * as_s0
        if ONE_WS:
            ws_at = ws_ptr + e * ws_s0 + (pid_n * BN // BN_Q) * ws_s1
        else:
            ws_at = ws_ptr + e * ws_s0 + (cols // BN_Q) * ws_s1
        a_s = tl.load(as_rows, mask=row_ok, other=0.0)
        w_s = tl.load(ws_at) if ONE_WS else tl.load(ws_at, mask=col_ok, other=0.0)
        c_acc = tl.full((BM,), 1.0, dtype=tl.float32)  # acc's unit: 1 until the first block
        if SWIGLU:  # up's rows and scale block: N rows (N / BN_Q blocks) past gate's
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            c_acc_up = tl.full((BM,), 1.0, dtype=tl.float32)
            ws_up_at = ws_at + (N // BN_Q) * ws_s1
            w_s_up = tl.load(ws_up_at)
        last = K // BK - 1
        for kb in range(0, K // BK):
            nxt = tl.minimum(kb + 1, last)
            a_s_next = tl.load(as_rows + nxt * as_s1, mask=row_ok, other=0.0)
            if ONE_WS:
                w_s_next = tl.load(ws_at + nxt * ws_s2)
            else:
                w_s_next = tl.load(ws_at + nxt * ws_s2, mask=col_ok, other=0.0)
            k = kb * BK + ks
            if TMA_A:
                a = a_ptr.load([row0, kb * BK])
            else:
                a = tl.load(a_ptr + src[:, None].to(tl.int64) * K + k[None, :],
                            mask=row_ok[:, None], other=0.0)
            if TMA_W:
                b = w_base.load([e * N + pid_n * BN, kb * BK]).T  # [BK, BN]
            else:
                b = tl.load(w_base + cols[None, :].to(tl.int64) * K + k[:, None],
                            mask=col_ok[None, :], other=0.0)  # [BK, BN]
            if UPCAST:  # the interpreter has no FP8 dot
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if ONE_WS:  # acc in units of this block's row scales, the MMA chained onto it
                acc, c_acc = _rescaled_dot(a, b, acc, c_acc, a_s, w_s)
            else:
                acc += tl.dot(a, b) * a_s[:, None] * w_s[None, :]
            if SWIGLU:
                w_s_up_next = tl.load(ws_up_at + nxt * ws_s2)
                b_up = tl.load(w_base + (N + cols)[None, :].to(tl.int64) * K + k[:, None],
                               mask=col_ok[None, :], other=0.0)
                if UPCAST:
                    b_up = b_up.to(tl.float32)
                acc_up, c_acc_up = _rescaled_dot(a, b_up, acc_up, c_acc_up, a_s, w_s_up)
                w_s_up = w_s_up_next
            a_s = a_s_next
            w_s = w_s_next
        if ONE_WS:
            acc *= c_acc[:, None]
        if SWIGLU:  # rounded as the unfused GEMM stores gate and up, then as the SwiGLU
            gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            up = (acc_up * c_acc_up[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = swiglu_act(gate, up, limit, CLAMP)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---- skinny FP8 GEMM (decode) -----------------------------------------------------------

# At decode sizes F.scaled_mm's block-wise kernel is far from the weight read it should cost:
# on the H200 at Qwen3-30B-A3B's attention shapes, 9-14 us a call where reading the ~8-10 MB
# of FP8 weights takes ~2 us. The skinny GEMM holds every row in one tile, so each weight
# byte is read once, and multiplies FP8 x FP8 as the decode experts' W8A8 kernel
# (moe/fused_moe.py) does, on rows `quantize_act` quantized ahead. Quantizing inside the
# GEMM instead was as fast for 1-16 rows and 1.5-2x slower at 64 (every one of its 128-320
# programs quantized the whole tile again); bench/fp8_linear.py at 9b4f34c, quantize_act
# included: 8.7-11.2 us for qkv and 9.3-11.4 us for o_proj from 1 to 64 rows, against 11-13
# and 16-18 us for quantize_act + F.scaled_mm.
SKINNY_ROWS = 64  # the most rows one tile holds; fp8_linear takes it up to here


def skinny_fits(m: int, w: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `fp8_linear` takes `fp8_linear_skinny` for m rows: shapes only, so a captured
    CUDA graph keeps its kernel."""
    return 0 < m <= SKINNY_ROWS and tuple(block) == (128, 128) and w.shape[1] % 128 == 0


def skinny_config(m: int, n: int, k: int) -> dict:
    """Tiles of `fp8_linear_skinny` for [m, k] x [k, n]: 64 columns, 128 inputs a step, 4
    warps, 3 stages, K split in 4 ranges (fewer when K has fewer 128-input groups): the
    fastest of bench/fp8_linear.py's sweep at 9b4f34c (H200) for qkv and o_proj from 1 to 64
    rows, within 5% of each column's best. In 2 ranges where more than 32 rows meet 64 or
    more column tiles (qkv at batch 64): every range writes and rereads float32 partials of
    all rows, which there cost more than the programs a range adds; on an H100 at 64 rows
    (d2b4632, bench/results/fp8-linear-h100-d2b4632.log, quantize_act included) qkv took 11.2
    us in 2 ranges against 12.8 in 4, while o_proj's 32 tiles keep 4 (11.8 against 14.3).
    A tuned file's "skinny" tiles (cpmoe.ops.launch.tuned: columns, warps, stages) replace
    these; the split stays `skinny_split`'s."""
    cfg = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3} | launch.tuned("skinny")
    return {**cfg, "SPLIT_K": skinny_split(m, n, k)}


def skinny_split(m: int, n: int, k: int) -> int:
    """The K ranges of `skinny_config`: 2 for more than 32 rows of 4,096 or more columns,
    else 4, fewer where K has fewer 128-input groups."""
    ranges = 2 if m > 32 and n >= 4096 else 4
    split = 1
    while split < ranges and split * 2 <= k // 128:
        split *= 2
    return split


def fp8_linear_skinny(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                      w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None
                      ) -> torch.Tensor:
    """y = x (w * w_scale)^T (+ bias) for rows quantized by `quantize_act`: xq fp8
    [M <= SKINNY_ROWS, K] with x_scale [M, K/128] (any strides), w fp8 [N, K], w_scale
    float32 [ceil(N/128), K/128] -> [M, N] in out_dtype: `F.scaled_mm`'s product up to
    float32 summation order; the bias is added in float32, before the one rounding.
    SPLIT_K > 1: each program writes a float32 partial sum; the last of a column tile's
    SPLIT_K programs to finish (a counter in `_tile_counters`) adds them, in split order, so
    the sums are the same every run, whichever program arrives last. config:
    `skinny_config`'s."""
    M, K = xq.shape
    N = w.shape[0]
    if K % 128 or M > SKINNY_ROWS or w.stride(1) != 1 or xq.dtype != FP8:
        raise ValueError(f"skinny FP8 GEMM: {M} FP8 rows (at most {SKINNY_ROWS}, got "
                         f"{xq.dtype}) of {K} inputs (a multiple of 128), weight strides "
                         f"{w.stride()} (rows of K)")
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    cfg = config or skinny_config(M, N, K)
    split = cfg["SPLIT_K"]
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    part = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32,
                                              device=xq.device)
    counters = out if split == 1 else _tile_counters(xq.device, tiles)
    b = bias if bias is not None else out  # any pointer when there is no bias
    _skinny_fp8_kernel[(tiles, split)](
        xq, x_scale, w, w_scale, b, part, out, counters, M, N, K, xq.stride(0),
        x_scale.stride(0), x_scale.stride(1), w.stride(0), w_scale.stride(0),
        w_scale.stride(1), HAS_BIAS=bias is not None,
        BLOCK_M=max(16, triton.next_power_of_2(M)), UPCAST=_INTERPRET, **cfg,
        **pdl_args(xq))
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 16


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros, one a column tile, kept for the device: every skinny GEMM finds them zero
    and leaves them so (its last program of a tile sets its counter back), one launch after
    the other on the device's one stream. Made outside graph capture, by the warm-up run
    before each capture, so no graph's memory pool holds them."""
    if tiles > _MAX_TILES:
        raise ValueError(f"skinny FP8 GEMM: {tiles} column tiles, more than {_MAX_TILES}")
    counters = _COUNTERS.get(device)
    if counters is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny FP8 GEMM: first split-K call inside graph capture; "
                               "run the forward once before capturing")
        counters = _COUNTERS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32,
                                                   device=device)
    return counters


if triton is not None:
    # M and stride_xs_g (the row scales' column stride: M, `quantize_act`'s layout) change
    # every step (no variant per residue mod 16; see above)
    @triton.jit(do_not_specialize=["M", "stride_xs_g"])
    def _skinny_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, part_ptr, out_ptr, count_ptr,
                           M, N, K, stride_x, stride_xs_m, stride_xs_g, stride_w,
                           stride_ws_n, stride_ws_k,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                           UPCAST: tl.constexpr, PDL: tl.constexpr = False):
        """Program (n, s): every row times columns n-block over the s-th range of 128-input
        groups -> out (SPLIT_K 1: y with bias), or part[s] (float32 partials); then the last
        of the tile's programs to count itself in (count[n]) writes out: the partials
        summed in split order, with bias, and sets count[n] back to 0."""
        wait_for_producer(PDL)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, 128)
        groups = K // 128
        per = tl.cdiv(groups, SPLIT_K)
        g0 = tl.program_id(1) * per
        g_end = tl.minimum(g0 + per, groups)
        # a group's scales are loaded during the group before (the first before the loop):
        # Triton's pipeline prefetches only the tiles, and a load issued next to its dot
        # left its latency after every MMA's wait, with about one program an SM to hide it
        xs_at = xs_ptr + rows * stride_xs_m
        ws_at = ws_ptr + (cols // 128) * stride_ws_n
        g_first = tl.minimum(g0, groups - 1)  # an empty range reads a scale it never uses
        a_s = tl.load(xs_at + g_first * stride_xs_g, mask=row_ok, other=0.0)
        w_s = tl.load(ws_at + g_first * stride_ws_k, mask=col_ok, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(g0, g_end):
            nxt = tl.minimum(g + 1, g_end - 1)
            a_s_next = tl.load(xs_at + nxt * stride_xs_g, mask=row_ok, other=0.0)
            w_s_next = tl.load(ws_at + nxt * stride_ws_k, mask=col_ok, other=0.0)
            k = g * 128 + ks
            a = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None],
                        other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_w + k[:, None],
                        mask=col_ok[None, :], other=0.0)  # [128, BLOCK_N]
            if UPCAST:  # the interpreter has no FP8 dot
                part = tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                part = tl.dot(a, w)
            acc += part * a_s[:, None] * w_s[None, :]
            a_s = a_s_next
            w_s = w_s_next
        mask = row_ok[:, None] & col_ok[None, :]
        at = rows[:, None] * N + cols[None, :]
        last = True
        if SPLIT_K > 1:
            tl.store(part_ptr + tl.program_id(1) * M * N + at, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial, before the count releases them
            last = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel") == SPLIT_K - 1
            if last:  # the tile's last program: the sum, in split order
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # from L2: other SMs wrote them
                    acc += tl.load(part_ptr + s * M * N + at, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                tl.store(count_ptr + tl.program_id(0), 0)
        if last:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- dense FP8 linear -------------------------------------------------------------------

def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """Activations quantized per 1 x bk group, both sides dequantized, float32 matmul."""
    q, s = quantize_act_ref(x.reshape(-1, x.shape[-1]), block[1])
    y = dequantize(q, s, (1, block[1])) @ dequantize(w, w_scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])


# cuBLASLt's block-wise FP8 kernels on the H200 refused every row count tried that is not a
# multiple of 16 (1, 2, 13, 37, 1846) and took 64 and 4096: activations are padded to it
SCALED_MM_ROWS = 16
# (rows class, N, K) -> why F.scaled_mm refused that shape anyway; those take the Triton GEMM
_SCALED_MM_REFUSED: dict[tuple[int, int, int], str] = {}


def _shape_key(m: int, n: int, k: int) -> tuple[int, int, int]:
    return (min(m, 256), n, k)  # row counts past 256 share their fate (and one entry)


def scaled_mm_refusal(m: int, n: int, k: int) -> str | None:
    """Why F.scaled_mm refused an [m, k] x [k, n] FP8 GEMM here (None: it did not)."""
    return _SCALED_MM_REFUSED.get(_shape_key(m, n, k))


def _scaled_mm_fits(x: torch.Tensor, w: torch.Tensor, block: tuple[int, int]) -> bool:
    import torch.nn.functional as F
    return (x.is_cuda and tuple(block) == (128, 128) and hasattr(F, "scaled_mm")
            and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0)


def scaled_mm_weight_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """A weight's [N/128, K/128] block scales as F.scaled_mm's 128x128 recipe reads them:
    [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to 4 (the rows past K/128 are
    padding it never uses): a transposed view when K/128 is a multiple of 4, else a padded
    copy (make it once per weight: `Fp8Linear` keeps it)."""
    n, kb = w_scale.shape
    l4 = -(-kb // 4) * 4
    if l4 == kb and w_scale.is_contiguous():
        return w_scale.t()
    padded = torch.zeros(n, l4, dtype=w_scale.dtype, device=w_scale.device)
    padded[:, :kb] = w_scale
    return padded.t()


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None,
               mm_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x (w * w_scale)^T (+ bias) in x's dtype; x [.., K], w fp8 [N, K]. mm_scale:
    `scaled_mm_weight_scale(w_scale)` made ahead (else made here, per call)."""
    if not launch.use_triton(x):
        return fp8_linear_ref(x, w, w_scale, block, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if skinny_fits(m, w, block):
        q, s = quantize_act(x2, block[1])
        return fp8_linear_skinny(q, s, w, w_scale, bias, x.dtype).view(*shape[:-1], w.shape[0])
    rows = -(-m // SCALED_MM_ROWS) * SCALED_MM_ROWS
    key = _shape_key(rows, *w.shape)
    mm = key not in _SCALED_MM_REFUSED and _scaled_mm_fits(x, w, block)
    q, s = quantize_act(x2, block[1], rows if mm else m)
    y = None
    if mm:
        import torch.nn.functional as F
        if mm_scale is None:
            mm_scale = scaled_mm_weight_scale(w_scale)
        try:
            y = F.scaled_mm(q, w.t(), s, F.ScalingType.BlockWise1x128, mm_scale,
                            F.ScalingType.BlockWise128x128,
                            output_dtype=torch.bfloat16)[:m].to(x.dtype)  # checked on H200
        except (RuntimeError, ValueError) as e:  # no kernel for this shape: say so once
            _SCALED_MM_REFUSED[key] = str(e).splitlines()[0]
            warnings.warn(f"FP8 linear {list(x2.shape)} x {list(w.shape)}: F.scaled_mm "
                          f"refused block-wise scales ({_SCALED_MM_REFUSED[key]}); this "
                          f"shape uses the Triton GEMM", stacklevel=2)
    if y is None:
        q, s = q[:m], s[:m]
        offs = torch.full((1,), m, dtype=torch.int64, device=x.device)
        y = grouped_fp8_gemm(q, s, w[None], w_scale[None], offs, block, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], w.shape[0])
