"""Routed experts for few rows (decode), in three Triton kernels that never sync with the host.

A decode step routes M rows x top-K slots to E local experts. The grouped GEMM of prefill
(`torch.nn.functional.grouped_mm`) needs the slots sorted by expert (a radix sort per layer)
and reads every expert's weights through a generic grouped kernel; at decode sizes the step
is a memory-bound read of the used experts' weights, so this path is built around that read:

1. `_align_kernel`, one program per expert: scans the M*K slot ids and writes the slots routed
   to that expert, in slot order, into `slots[e, :count[e]]` (no sort, no host count).
2. `_expert_gemm_kernel` with GATED: program (e, n-block) reads expert e's gate and up rows
   n-block once, multiplies every slot routed to e (BLOCK_M at a time) and writes
   SiLU(gate) * up for those slots. An expert no slot chose exits before reading a byte.
3. the same kernel, not GATED, with the down projection -> one output row per slot.
4. `_slot_sum_kernel`: each row's routing-weighted sum over its K slots (a slot of another
   EP rank's expert, id -1, is not read).
Few kernels matter as much as few bytes: inside a CUDA graph each kernel still costs about a
microsecond of issue, and a 48-layer step runs each of these 48 times.
FP8 weights (128 x 128 block scales) are multiplied in one of FP8_ACT_MODES: weights-only
(each weight tile widened to 16 bits) or W8A8 (FP8 x FP8 dots, the rows quantized per 1 x 128
group by `quantize_act` before each GEMM, or inside the GEMM kernel itself).

Rounding: the activation is computed from the float32 accumulators and rounded to the weight
dtype once, where the grouped path rounds the gate/up output first; both are within the bf16
rounding of the float32 reference.

Legend: M rows, K top-k slots, P = M*K slots, E local experts, H hidden, I local intermediate.
"""

from __future__ import annotations

import os

import torch

from cpmoe._triton import import_triton
from cpmoe.ops.fp8 import FP8, quantize_act
from cpmoe.ops.launch import tuned

triton, tl = import_triton()  # None on CPU-only torch without the interpreter

MAX_SLOTS = 4096  # the decode path serves up to this many (row, slot) pairs per layer


def usable(x_MH: torch.Tensor, slots: int) -> bool:
    """Few slots, and on CUDA a 16-bit dtype (tl.dot would round float32 inputs to TF32; the
    float32 path on CUDA is a reference and keeps the loop). The interpreter computes in
    float32 exactly."""
    if triton is None or slots > MAX_SLOTS:
        return False
    if x_MH.is_cuda:
        return x_MH.dtype in (torch.bfloat16, torch.float16)
    return os.environ.get("TRITON_INTERPRET") == "1"


def takes_block_scales(experts) -> bool:
    """FP8 experts this path serves: 128 x 128 blocks, and widths that are whole blocks (a
    64-column tile then never straddles two scales)."""
    E, two_i, H = experts.gate_up_proj.shape
    return (tuple(getattr(experts, "fp8_block", ())) == (128, 128) and two_i % 256 == 0
            and H % 128 == 0)


def fused_experts(x_MH: torch.Tensor, local_ids_MK: torch.Tensor, weights_MK: torch.Tensor,
                  gate_up_EnH: torch.Tensor, down_EHI: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  swiglu_limit: float | None = None, fp8_act: str | None = None
                  ) -> torch.Tensor:
    """sum_k weights[m, k] * down[e] @ silu_and_mul(gate_up[e] @ x[m]) with e = ids[m, k]
    (id -1: another rank's expert, skipped) -> [M, H] in x's dtype. FP8 weights come with
    their 128 x 128 block scales (gate_up's, down's: [E, rows / 128, K / 128]) and are
    multiplied as `fp8_act` (default FP8_ACTIVATIONS) says. swiglu_limit: DeepSeek-V4's
    clamped SwiGLU, SiLU(min(gate, limit)) * clamp(up, -limit, limit)."""
    M, K = local_ids_MK.shape
    E, two_i, H = gate_up_EnH.shape
    I = two_i // 2
    P = M * K
    dev = x_MH.device
    ids_P = local_ids_MK.reshape(P)
    slots = torch.empty(E, P, dtype=torch.int32, device=dev)  # room for any routing
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    _align_kernel[(E,)](ids_P, slots, counts, P, P, BLOCK_P=min(1024, _pow2(P)),
                        **pdl_args(x_MH))
    gate_up_s, down_s = scales or (None, None)
    fp8 = scales is not None
    cfg = gemm_config(P, E, H, fp8, fp8_act)
    # QUANT_OUT: gate/up writes the gated rows in FP8 with their scales, as down reads them
    act_s = (torch.empty(I // 128, P, dtype=torch.float32, device=dev)
             if cfg.get("QUANT_OUT") else None)
    act = torch.empty(P, I, dtype=x_MH.dtype if act_s is None else FP8, device=dev)
    _gemm(x_MH, gate_up_EnH, slots, counts, act, K, row_of_slot=True, gated=True,
          config=cfg, scale=gate_up_s, limit=swiglu_limit, out_scale=act_s)
    y = torch.empty(P, H, dtype=x_MH.dtype, device=dev)
    _gemm(act, down_EHI, slots, counts, y, K, row_of_slot=False, gated=False,
          config=gemm_config(P, E, I, fp8, fp8_act, gated=False), scale=down_s,
          a_scale=None if act_s is None else act_s.t())
    out = torch.empty_like(x_MH)
    block = min(1024, _pow2(H))
    _slot_sum_kernel[(M, triton.cdiv(H, block))](y, ids_P, weights_MK.contiguous(), out, H,
                                                  K=K, BLOCK=block, **pdl_args(x_MH))
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_m(slots: int, experts: int) -> int:
    """Rows per tile: twice the mean slots per expert, 16 (tl.dot's least) to 64, so a busy
    expert's weights are read once or twice rather than once per 16 rows."""
    return max(16, min(64, _pow2(-(-2 * slots // experts))))


# How the GEMMs multiply FP8 weights (each scale block is 128 x 128):
# - "weights": weights-only FP8, each weight tile widened to the activations' 16-bit dtype (a
#   decode step reads half the bytes; the activations keep their precision);
# - "w8a8": FP8 x FP8 dots, the rows quantized per 1 x 128 group first (`quantize_act`,
#   one more launch per GEMM, unless the kernel that wrote the rows quantized them too: the
#   Qwen RMSNorm before the experts does), as the checkpoints' `activation_scheme: dynamic`
#   and the prefill path (cpmoe/moe/fp8_experts.py) do;
# - "w8a8-fused": the same numbers, each GEMM program quantizing the rows it reads itself
#   (no launch; every column tile repeats the work on its rows).
# "w8a8" is the default: on the H200 at Qwen3-30B-A3B's shape (bench-one-batch, uniform
# routing, input 1,024, 56b3a81) a decode step took 12.68 ms at batch 64 and 4.21 ms at
# batch 1, against 14.63 / 4.31 ms weights-only (bf16 17.36 / 3.72 in the same call); the
# GEMMs alone at 64 rows: gate/up 104 vs 135 us, down 62 vs 72 us (bench/decode_kernels.py).
# $CPMOE_FP8_DECODE_ACTIVATIONS picks the mode for a process (its ranks inherit it).
FP8_ACT_MODES = ("weights", "w8a8", "w8a8-fused")
FP8_ACTIVATIONS = os.environ.get("CPMOE_FP8_DECODE_ACTIVATIONS", "w8a8")


def gemm_config(slots: int, experts: int, k_dim: int, fp8: bool = False,
                fp8_act: str | None = None, gated: bool = True) -> dict:
    """Tile sizes and launch shape of one expert GEMM of `slots` (row, slot) pairs: BLOCK_M
    rows (`_block_m`), 64 columns and 128 of K per tile, and COMPACT when fewer slots than
    experts: the grid then has one row of programs per slot, each finding the expert it
    serves among those with work (batch 1 launches 8 rows of programs, not 128 mostly empty
    ones). Swept on an H200 at Qwen3-30B-A3B's expert shape inside a CUDA graph
    (bench/decode_kernels.py): at 1, 16 and 64 rows this is the fastest or within 3% of it,
    and 5 pipeline stages beat 3 only in the compact case. FP8 weights (`fp8`), multiplied
    as `fp8_act` says (an FP8_ACT_MODES entry, default FP8_ACTIVATIONS): 32 columns and 3
    stages everywhere, the fastest weights-only tiles of the same sweep with `--fp8` at 1,
    16 and 64 rows (5-20% under the bf16 tiles at batch 1, 7% for gate/up at 64). W8A8
    ("w8a8") with at least as many slots as experts takes 64 columns and 256 of K (two
    dots of 128 a step): its sweep at 64 rows (9b4f34c, H200) timed down 58.5 against 63.1
    us with 32 columns, gate/up 104.3 with 256 of K against 106.3 with 128; on an H100
    (4ebe13c, bench/results/decode-kernels-fp8-h100-4ebe13c.log) gate/up 135.4 against
    138.2 and down 75.5 against 76.1; the compact case was not swept. There the down GEMM
    (not `gated`) copies its weight tiles by TMA descriptor (TMA_W): on an H200 at 1d2b62c
    57.0 / 60.3 us at 64 / 128 rows against 62.2 / 65.8 by address, the decode step at
    batch 64 11.55 against 11.87 ms (bench/results/decode-kernels-h200-1d2b62c.log); on an
    H100 at f3c85f6 74.8 against 75.3 us. Gate/up by TMA was 1.7% faster on the H200 and 1%
    slower on the H100 (decode-kernels-tma-ahead-h100-f3c85f6.log), so it keeps the
    address loads."""
    compact = slots < experts
    mode = (fp8_act or FP8_ACTIVATIONS) if fp8 else "weights"
    if mode not in FP8_ACT_MODES:
        raise ValueError(f"FP8 decode activations (CPMOE_FP8_DECODE_ACTIVATIONS or fp8_act): "
                         f"expected one of {FP8_ACT_MODES}, got {mode!r}")
    wide = mode == "w8a8" and not compact
    block_n = 32 if fp8 and not wide else 64
    block_k = 256 if wide and k_dim % 256 == 0 else 128
    cfg = {"BLOCK_M": _block_m(slots, experts), "BLOCK_N": block_n,
           "BLOCK_K": block_k if k_dim >= 128 else _pow2(max(16, k_dim)), "COMPACT": compact,
           "ACT_FP8": mode != "weights", "QUANT_A": mode == "w8a8-fused",
           "TMA_W": wide and not gated, "TILES": 1, "QUANT_OUT": False, "num_warps": 4,
           "num_stages": 5 if compact and not fp8 else 3}
    if wide:  # $CPMOE_DECODE_KERNELS_CONFIG's tiles (cpmoe.ops.launch.tuned)
        cfg.update(tuned("gate_up" if gated else "down"))
    return cfg


def _gemm(a: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
          out: torch.Tensor, top_k: int, row_of_slot: bool, gated: bool,
          config: dict | None = None, scale: torch.Tensor | None = None,
          limit: float | None = None, a_scale: torch.Tensor | None = None,
          out_scale: torch.Tensor | None = None) -> None:
    """One expert GEMM (`_expert_gemm_kernel`) of `config` (default `gemm_config`'s); with
    ACT_FP8 and not QUANT_A, a's quantization (`quantize_act`) is part of it, unless `a`
    comes quantized with its `a_scale` ([rows, K / 128]). QUANT_OUT: `out` is FP8 and
    `out_scale` [N / 128, slots] gets its scales."""
    E, n_rows, k_dim = w.shape
    N = n_rows // 2 if gated else n_rows
    P = slots.shape[1]
    cfg = config or gemm_config(P, E, k_dim, fp8=scale is not None, gated=gated)
    scaled = scale is not None
    if scaled:  # one scale per dot: tiles must not straddle 128 x 128 blocks
        assert 128 % cfg["BLOCK_N"] == 0 and N % 128 == 0 and k_dim % 128 == 0
        assert 128 % cfg["BLOCK_K"] == 0 or k_dim % cfg["BLOCK_K"] == 0  # whole pieces
    assert scaled or not cfg["ACT_FP8"], "FP8 activations need FP8 weights"
    a_dtype = a.dtype  # QUANT_OUT rounds to it: the dtype of out's unquantized rows
    if cfg["ACT_FP8"] and not cfg["QUANT_A"] and a_scale is None:
        a, a_scale = quantize_act(a, 128)
    a_scale = a if a_scale is None else a_scale  # any pointer when the kernel reads none
    quant_out = cfg.get("QUANT_OUT", False)
    if quant_out and not (gated and cfg["BLOCK_N"] == 128 and out.dtype == FP8
                          and out_scale is not None):
        raise ValueError(f"fused experts: QUANT_OUT takes the gated GEMM's 128-column tiles "
                         f"into FP8 rows with their scales, got gated={gated}, BLOCK_N "
                         f"{cfg['BLOCK_N']}, out {out.dtype}")
    out_s = out_scale if quant_out else out  # any pointer when the kernel writes none
    assert not cfg["QUANT_A"] or cfg["BLOCK_K"] >= 128, "in-kernel groups are 128 inputs"
    pieces = max(1, cfg["BLOCK_K"] // 128) if scaled else 1
    rows = min(E, P) if cfg["COMPACT"] else E
    s = scale if scaled else w  # any pointer when not SCALED
    if cfg.get("TMA_W") and not w.is_contiguous():  # one descriptor over [E * n_rows, K]
        raise ValueError(f"fused experts: TMA_W needs contiguous weights [E, N, K], got "
                         f"strides {w.stride()} for shape {tuple(w.shape)}")
    # TMA_W: the weight tiles copied by the TMA unit, boxes of BLOCK_N rows x one piece of K
    w_in = tma_descriptor(w.view(E * n_rows, k_dim), cfg["BLOCK_N"],
                       cfg["BLOCK_K"] // pieces) if cfg.get("TMA_W") else w
    _expert_gemm_kernel[(rows, triton.cdiv(N, cfg["BLOCK_N"] * cfg.get("TILES", 1)))](
        a, a_scale, w_in, s, slots, counts, out, out_s, N, k_dim, P,
        top_k if row_of_slot else 1, a.stride(0), a_scale.stride(0), a_scale.stride(-1),
        w.stride(0), w.stride(1), out.stride(0), out_s.stride(0) if quant_out else 0, E,
        s.stride(0) if scaled else 0, s.stride(1) if scaled else 0,
        0.0 if limit is None else float(limit), GATED=gated, E_POW2=_pow2(E),
        SCALED=scaled, UPCAST=not a.is_cuda, CLAMP=limit is not None, K_PIECES=pieces,
        ROUND=_TL_DTYPES[a_dtype] if quant_out else None, **cfg, **pdl_args(a))


if triton is not None:
    # the in-kernel row quantization; programmatic dependent launch
    from cpmoe.ops import pdl_args
    from cpmoe.ops.fp8 import quantize_rows
    from cpmoe.ops.fp8_gemm import tma_descriptor
    from cpmoe.ops.launch import wait_for_producer

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                  torch.float32: tl.float32}

    # a size that changes every step: no specialization on it (Triton would compile a
    # new variant, ~1 s, for each new residue mod 16 it meets while serving)
    @triton.jit(do_not_specialize=["P", "cap"])
    def _align_kernel(ids_ptr, slots_ptr, counts_ptr, P, cap, BLOCK_P: tl.constexpr,
                      PDL: tl.constexpr = False):
        wait_for_producer(PDL)
        e = tl.program_id(0)
        base = tl.sum(tl.zeros([BLOCK_P], dtype=tl.int32), axis=0)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
            hit = (ids == e).to(tl.int32)
            at = base + tl.cumsum(hit, axis=0) - 1
            tl.store(slots_ptr + e * cap + at, p, mask=hit != 0)
            base += tl.sum(hit, axis=0)
        tl.store(counts_ptr + e, base)

    @triton.jit
    def _slot_sum_kernel(y_ptr, ids_ptr, weight_ptr, out_ptr, H, K: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_producer(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            p = row * K + k
            w = tl.load(weight_ptr + p).to(tl.float32)
            local = (tl.zeros([BLOCK], dtype=tl.int32) + tl.load(ids_ptr + p)) >= 0
            vals = tl.load(y_ptr + p * H + cols, mask=mask & local, other=0.0)
            acc += w * vals.to(tl.float32)
        tl.store(out_ptr + row * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    # likewise: no specialization on the sizes that change every step (stride_as_k: the row
    # scales' column stride, their rows, `quantize_act`'s layout; stride_os_k: likewise the
    # QUANT_OUT scales')
    @triton.jit(do_not_specialize=["cap", "stride_as_k", "stride_os_k"])
    def _expert_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, slots_ptr, counts_ptr, out_ptr,
                            os_ptr, N, K_DIM, cap, rows_per_a, stride_a, stride_as, stride_as_k,
                            stride_we, stride_wn, stride_out, stride_os_k, E, stride_se,
                            stride_sn, limit,
                            GATED: tl.constexpr, E_POW2: tl.constexpr, SCALED: tl.constexpr,
                            ACT_FP8: tl.constexpr, QUANT_A: tl.constexpr, UPCAST: tl.constexpr,
                            CLAMP: tl.constexpr, COMPACT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, K_PIECES: tl.constexpr,
                            TMA_W: tl.constexpr = False, TILES: tl.constexpr = 1,
                            QUANT_OUT: tl.constexpr = False, ROUND: tl.constexpr = None,
                            PDL: tl.constexpr = False):
        """Rows of `a` (slot p reads row p // rows_per_a) routed to expert e, times expert e's
        rows n-block of w ([E, N or 2N, K_DIM]) -> out[p, n-block]; GATED: w holds gate rows
        then up rows, and out gets SiLU(gate) * up. Program row t serves expert t, or with
        COMPACT the t-th expert (in id order) that has slots. SCALED: w is FP8 with one
        float32 scale per 128 x 128 block (s [E, rows / 128, K_DIM / 128]); each BLOCK_K step
        is K_PIECES dots of BLOCK_K / K_PIECES inputs, each inside one block (K_DIM: whole
        steps when K_PIECES > 1). ACT_FP8 (W8A8):
        the rows are FP8 too, with a float32 scale per row and 128 inputs (as, [.., K_DIM /
        128]), and each piece is an FP8 x FP8 dot scaled by both; QUANT_A: the kernel
        quantizes its 16-bit rows so itself (as unused; a piece is then one 128-input group).
        Else the weight tile is widened to a's dtype (weights-only FP8). UPCAST: FP8 dots in
        float32 (the interpreter has none). CLAMP: the gate is clamped to <= limit and up to
        [-limit, limit] before SiLU(gate) * up. TMA_W: w_ptr is a TMA descriptor of the
        weights as one [E rows, K_DIM] matrix in [BLOCK_N, PIECE] boxes (a box past an
        expert's rows holds the next expert's, which the store masks; past K_DIM, zeros).
        TILES: program column t writes TILES n-blocks in a row, t * TILES onwards, in one
        loop over their K steps. QUANT_OUT (BLOCK_N 128, one activation group): out gets the
        FP8 rows of `quantize_act` of the result rounded to ROUND (the dtype the rows would
        have had) and os [N / 128, cap] (stride_os_k) their scales."""
        wait_for_producer(PDL)
        PIECE: tl.constexpr = BLOCK_K // K_PIECES
        if COMPACT:
            t = tl.program_id(0)
            ex = tl.arange(0, E_POW2)
            cnt = tl.load(counts_ptr + ex, mask=ex < E, other=0)
            used = (cnt > 0).to(tl.int32)
            pick = (tl.cumsum(used, axis=0) == t + 1) & (used > 0)
            e = tl.sum(tl.where(pick, ex, 0), axis=0)
            count = tl.sum(tl.where(pick, cnt, 0), axis=0)  # 0 past the last used expert
        else:
            e = tl.program_id(0)
            count = tl.load(counts_ptr + e)
        W_ROWS: tl.constexpr = 2 if GATED else 1  # weight rows an output column: gate, up
        w_e = w_ptr if TMA_W else w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        n_first = tl.program_id(1) * (TILES * BLOCK_N)
        steps = tl.cdiv(K_DIM, BLOCK_K)
        for m0 in range(0, count, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < count
            p = tl.load(slots_ptr + e * cap + offs_m, mask=m_ok, other=0).to(tl.int64)
            a_rows = a_ptr + (p // rows_per_a) * stride_a
            as_rows = as_ptr + (p // rows_per_a) * stride_as
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            offs_n = n_first + tl.arange(0, BLOCK_N)
            # one loop over the program's TILES column tiles x their K steps, so the weight
            # copies of the next tile are in flight while this one ends (a loop per tile
            # would drain the pipeline at each tile's end)
            for it in range(0, TILES * steps):
                k0 = (it % steps) * BLOCK_K
                n0 = n_first + (it // steps) * BLOCK_N
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < N
                s_gate = s_e + (n0 // 128) * stride_sn
                s_up = s_gate + (N // 128) * stride_sn
                for j in tl.static_range(K_PIECES):
                    offs_k = k0 + j * PIECE + tl.arange(0, PIECE)
                    k_ok = offs_k < K_DIM
                    a = tl.load(a_rows[:, None] + offs_k[None, :],
                                mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    if TMA_W:
                        w = w_e.load([e * W_ROWS * N + n0, k0 + j * PIECE]).T
                        if GATED:
                            u = w_e.load([e * W_ROWS * N + N + n0, k0 + j * PIECE]).T
                    else:
                        w_mask = k_ok[:, None] & n_ok[None, :]
                        w = tl.load(w_e + offs_n[None, :] * stride_wn + offs_k[:, None],
                                    mask=w_mask, other=0.0)
                        if GATED:
                            u = tl.load(w_e + (N + offs_n)[None, :] * stride_wn
                                        + offs_k[:, None], mask=w_mask, other=0.0)
                    if SCALED:  # one weight scale per piece
                        kb = (k0 + j * PIECE) // 128
                        w_s = tl.load(s_gate + kb)
                        if GATED:
                            u_s = tl.load(s_up + kb)
                    if ACT_FP8:
                        if QUANT_A:  # as quantize_act: amax / 448 per row, round to nearest
                            a, a_s = quantize_rows(a.to(tl.float32))
                        else:
                            a_s = tl.load(as_rows + kb * stride_as_k, mask=m_ok, other=0.0)
                        if UPCAST:
                            a = a.to(tl.float32)
                            w = w.to(tl.float32)
                            if GATED:
                                u = u.to(tl.float32)
                        # a dot per piece, summed in float32: Hopper's FP8 MMA accumulates
                        # with fewer bits, here over 128 inputs at most
                        acc += tl.dot(a, w) * (a_s[:, None] * w_s)
                        if GATED:
                            acc_up += tl.dot(a, u) * (a_s[:, None] * u_s)
                    elif SCALED:
                        acc += tl.dot(a, w.to(a.dtype)) * w_s
                        if GATED:
                            acc_up += tl.dot(a, u.to(a.dtype)) * u_s
                    else:
                        acc = tl.dot(a, w, acc)
                        if GATED:
                            acc_up = tl.dot(a, u, acc_up)
                if TILES > 1:
                    if it % steps == steps - 1:  # the tile's last K step: write it
                        _store_tile(acc, acc_up, out_ptr, os_ptr, p, offs_n, m_ok, N,
                                    stride_out, stride_os_k, limit, GATED, CLAMP, QUANT_OUT,
                                    ROUND)
                        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if TILES == 1:
                _store_tile(acc, acc_up, out_ptr, os_ptr, p, offs_n, m_ok, N, stride_out,
                            stride_os_k, limit, GATED, CLAMP, QUANT_OUT, ROUND)

    @triton.jit
    def _store_tile(acc, acc_up, out_ptr, os_ptr, p, offs_n, m_ok, N, stride_out, stride_os_k,
                    limit, GATED: tl.constexpr, CLAMP: tl.constexpr, QUANT_OUT: tl.constexpr,
                    ROUND: tl.constexpr):
        """One output tile: the float32 sums (GATED: SiLU(gate) * up of them, CLAMP first)
        into out's rows p, columns offs_n, in out's dtype; QUANT_OUT: rounded to ROUND, then
        quantized per row as `quantize_act` does, the scales into os (the kernel's doc)."""
        if GATED:
            if CLAMP:
                acc = tl.minimum(acc, limit)
                acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        mask = m_ok[:, None] & (offs_n < N)[None, :]
        if QUANT_OUT:
            acc, scale = quantize_rows(acc.to(ROUND).to(tl.float32))
            tl.store(os_ptr + p + (tl.min(offs_n, axis=0) // 128) * stride_os_k, scale,
                     mask=m_ok)
        tl.store(out_ptr + p[:, None] * stride_out + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
