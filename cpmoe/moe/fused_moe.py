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
Or ("layer", DECODE_KERNELS) 2 and 3 are one kernel, `_expert_layer_kernel`: program (e, s)
runs expert e's whole MLP on its slots over the s-th range of its intermediate columns, so
a layer's expert weights stream through one launch, with no ramp and drain between two
GEMMs (and, with FP8, no launch quantizing the gated output); step 4 adds the ranges.
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
from cpmoe.quant.formats import FP8
from cpmoe.quant.kernels import quantize_act

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
    _align_kernel[(E,)](ids_P, slots, counts, P, P, BLOCK_P=min(1024, _pow2(P)))
    fp8 = scales is not None
    cfg = layer_config(P, E, H, I, fp8, fp8_act, sms=_sm_count(dev))
    if cfg is not None:
        y = _layer(x_MH, gate_up_EnH, down_EHI, slots, counts, K, cfg, scales, swiglu_limit)
    else:
        gate_up_s, down_s = scales or (None, None)
        act = torch.empty(P, I, dtype=x_MH.dtype, device=dev)
        _gemm(x_MH, gate_up_EnH, slots, counts, act, K, row_of_slot=True, gated=True,
              config=gemm_config(P, E, H, fp8, fp8_act), scale=gate_up_s, limit=swiglu_limit)
        y = torch.empty(1, P, H, dtype=x_MH.dtype, device=dev)
        _gemm(act, down_EHI, slots, counts, y[0], K, row_of_slot=False, gated=False,
              config=gemm_config(P, E, I, fp8, fp8_act), scale=down_s)
    out = torch.empty_like(x_MH)
    block = min(1024, _pow2(H))
    _slot_sum_kernel[(M, triton.cdiv(H, block))](y, ids_P, weights_MK.contiguous(), out, H, P,
                                                  K=K, SPLIT=y.shape[0], BLOCK=block)
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
#   one more launch per GEMM), as the checkpoints' `activation_scheme: dynamic` and the
#   prefill path (cpmoe/quant/experts.py) do;
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
                fp8_act: str | None = None) -> dict:
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
    ("w8a8") with at least as many slots as experts takes 64 columns: its sweep at 64 rows
    (9b4f34c) timed down 58.5 against 63.1 us with 32, gate/up 106.3 against 106.5 (the
    best, 104.3 with 256 of K, is within 2%); the compact case was not swept."""
    compact = slots < experts
    mode = _act_mode(fp8, fp8_act)
    block_n = 32 if fp8 and not (mode == "w8a8" and not compact) else 64
    return {"BLOCK_M": _block_m(slots, experts), "BLOCK_N": block_n,
            "BLOCK_K": 128 if k_dim >= 128 else _pow2(max(16, k_dim)), "COMPACT": compact,
            "ACT_FP8": mode != "weights", "QUANT_A": mode == "w8a8-fused",
            "num_warps": 4, "num_stages": 5 if compact and not fp8 else 3}


def _act_mode(fp8: bool, fp8_act: str | None) -> str:
    """How the GEMMs multiply: "weights" for 16-bit weights, else the FP8_ACT_MODES entry."""
    mode = (fp8_act or FP8_ACTIVATIONS) if fp8 else "weights"
    if mode not in FP8_ACT_MODES:
        raise ValueError(f"FP8 decode activations (CPMOE_FP8_DECODE_ACTIVATIONS or fp8_act): "
                         f"expected one of {FP8_ACT_MODES}, got {mode!r}")
    return mode

def _gemm(a: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
          out: torch.Tensor, top_k: int, row_of_slot: bool, gated: bool,
          config: dict | None = None, scale: torch.Tensor | None = None,
          limit: float | None = None) -> None:
    """One expert GEMM (`_expert_gemm_kernel`) of `config` (default `gemm_config`'s); with
    ACT_FP8 and not QUANT_A, a's quantization (`quantize_act`) is part of it."""
    E, n_rows, k_dim = w.shape
    N = n_rows // 2 if gated else n_rows
    P = slots.shape[1]
    cfg = config or gemm_config(P, E, k_dim, fp8=scale is not None)
    scaled = scale is not None
    if scaled:  # one scale per dot: tiles must not straddle 128 x 128 blocks
        assert 128 % cfg["BLOCK_N"] == 0 and N % 128 == 0 and k_dim % 128 == 0
        assert 128 % cfg["BLOCK_K"] == 0 or k_dim % cfg["BLOCK_K"] == 0  # whole pieces
    assert scaled or not cfg["ACT_FP8"], "FP8 activations need FP8 weights"
    a_scale = a  # any pointer when the kernel reads no activation scales
    if cfg["ACT_FP8"] and not cfg["QUANT_A"]:
        a, a_scale = quantize_act(a, 128)
    assert not cfg["QUANT_A"] or cfg["BLOCK_K"] >= 128, "in-kernel groups are 128 inputs"
    pieces = max(1, cfg["BLOCK_K"] // 128) if scaled else 1
    rows = min(E, P) if cfg["COMPACT"] else E
    s = scale if scaled else w  # any pointer when not SCALED
    _expert_gemm_kernel[(rows, triton.cdiv(N, cfg["BLOCK_N"]))](
        a, a_scale, w, s, slots, counts, out, N, k_dim, P, top_k if row_of_slot else 1,
        a.stride(0), a_scale.stride(0), a_scale.stride(-1), w.stride(0), w.stride(1),
        out.stride(0), E, s.stride(0) if scaled else 0, s.stride(1) if scaled else 0,
        0.0 if limit is None else float(limit), GATED=gated, E_POW2=_pow2(E),
        SCALED=scaled, UPCAST=not a.is_cuda, CLAMP=limit is not None, K_PIECES=pieces,
        **cfg)


# How a decode step runs its experts: "layer", the whole MLP in one kernel
# (`_expert_layer_kernel`: gate/up, the activation and its quantization, down), or "gemms",
# the gate/up and down GEMMs as two (`_expert_gemm_kernel`). $CPMOE_DECODE_EXPERTS picks it
# for a process (its ranks inherit it).
DECODE_KERNELS = ("layer", "gemms")
DECODE_KERNEL = os.environ.get("CPMOE_DECODE_EXPERTS", "layer")


def layer_config(slots: int, experts: int, hidden: int, inter: int, fp8: bool = False,
                 fp8_act: str | None = None, kernel: str | None = None, sms: int = 132
                 ) -> dict | None:
    """The launch of `_expert_layer_kernel` for `slots` (row, slot) pairs over `experts`
    local experts of [hidden, inter], or None when `kernel` (default DECODE_KERNEL) is
    "gemms". BLOCK_I intermediate columns a chunk (128 with FP8: a quantization group and
    a scale block), BLOCK_K hidden inputs a gate/up step, BLOCK_N output columns a down
    step; SPLIT ranges of the intermediate columns (a program each per expert): the fewest
    that dividing the chunks gives `sms` programs, so every SM streams weights. FP8 weights
    multiply as `fp8_act` says (FP8_ACT_MODES; "w8a8-fused": the kernel quantizes x)."""
    kernel = kernel or DECODE_KERNEL
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode experts kernel (CPMOE_DECODE_EXPERTS): expected one of "
                         f"{DECODE_KERNELS}, got {kernel!r}")
    mode = _act_mode(fp8, fp8_act)
    if kernel == "gemms":
        return None
    compact = slots < experts
    rows = min(slots, experts) if compact else experts
    block_i = 128 if fp8 else min(128, _pow2(max(16, inter)))
    chunks = -(-inter // block_i)
    split = next((d for d in range(1, chunks + 1) if chunks % d == 0 and rows * d >= sms),
                 chunks)
    return {"BLOCK_M": _block_m(slots, experts), "BLOCK_I": block_i,
            "BLOCK_K": 128 if fp8 else min(64, _pow2(max(16, hidden))),
            "BLOCK_N": min(128, _pow2(max(16, hidden))), "SPLIT": split, "COMPACT": compact,
            "ACT_FP8": mode != "weights", "QUANT_X": mode == "w8a8-fused",
            "num_warps": 4, "num_stages": 3}


def _sm_count(device: torch.device) -> int:
    """The device's SMs; off CUDA (the interpreter) the H200's 132, the grid it gets."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _layer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, slots: torch.Tensor,
           counts: torch.Tensor, top_k: int, cfg: dict,
           scales: tuple[torch.Tensor, torch.Tensor] | None = None,
           limit: float | None = None) -> torch.Tensor:
    """Every slot's expert MLP (`_expert_layer_kernel` of `layer_config` cfg) -> y [SPLIT, P,
    H] float32, the SPLIT partial sums of each slot's output (slots no program serves are
    not written)."""
    E, two_i, H = w1.shape
    I = two_i // 2
    P = slots.shape[1]
    dev = x.device
    split, act_fp8 = cfg["SPLIT"], cfg["ACT_FP8"]
    scaled = scales is not None
    assert scaled or not act_fp8, "FP8 activations need FP8 weights"
    assert not act_fp8 or (cfg["BLOCK_I"] == 128 and I % 128 == 0 and cfg["BLOCK_K"] == 128)
    assert -(-I // cfg["BLOCK_I"]) % split == 0, "SPLIT must divide the chunks"
    x = x if x.stride(1) == 1 else x.contiguous()
    xq, xs = x, x  # xs: any pointer when the kernel reads no scales
    if act_fp8 and not cfg["QUANT_X"]:
        xq, xs = quantize_act(x, 128)
    act = torch.empty(P, I, dtype=FP8 if act_fp8 else x.dtype, device=dev)
    acts = torch.empty(P, I // 128, dtype=torch.float32, device=dev) if act_fp8 else act
    y = torch.empty(split, P, H, dtype=torch.float32, device=dev)
    s1, s2 = scales if scaled else (w1, w2)  # any pointers when not SCALED
    rows = min(E, P) if cfg["COMPACT"] else E
    _expert_layer_kernel[(rows, split)](
        x, xq, xs, w1, s1, w2, s2, slots, counts, act, acts, y, H, I, P, top_k, E,
        xq.stride(0), xs.stride(0), xs.stride(-1), w1.stride(0), w1.stride(1), w2.stride(0),
        w2.stride(1), s1.stride(0) if scaled else 0, s1.stride(1) if scaled else 0,
        s2.stride(0) if scaled else 0, s2.stride(1) if scaled else 0,
        0.0 if limit is None else float(limit), E_POW2=_pow2(E), SCALED=scaled,
        UPCAST=not x.is_cuda, CLAMP=limit is not None, **cfg)
    return y


if triton is not None:
    from cpmoe.quant.kernels import quantize_rows  # the in-kernel row quantization

    # a size that changes every step: no specialization on it (Triton would compile a
    # new variant, ~1 s, for each new residue mod 16 it meets while serving)
    @triton.jit(do_not_specialize=["P", "cap"])
    def _align_kernel(ids_ptr, slots_ptr, counts_ptr, P, cap, BLOCK_P: tl.constexpr):
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

    @triton.jit(do_not_specialize=["P"])
    def _slot_sum_kernel(y_ptr, ids_ptr, weight_ptr, out_ptr, H, P, K: tl.constexpr,
                         SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """out[row] = sum over its K slots p (id >= 0) of weight[p] * sum_s y[s, p]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            p = row * K + k
            w = tl.load(weight_ptr + p).to(tl.float32)
            local = (tl.zeros([BLOCK], dtype=tl.int32) + tl.load(ids_ptr + p)) >= 0
            for s in tl.static_range(SPLIT):
                vals = tl.load(y_ptr + (s * P + p) * H + cols, mask=mask & local, other=0.0)
                acc += w * vals.to(tl.float32)
        tl.store(out_ptr + row * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _program_expert(counts_ptr, E, E_POW2: tl.constexpr, COMPACT: tl.constexpr):
        """(expert, its slot count) of program row t: expert t, or with COMPACT the t-th
        expert (in id order) that has slots (count 0 past the last one)."""
        t = tl.program_id(0)
        if COMPACT:
            ex = tl.arange(0, E_POW2)
            cnt = tl.load(counts_ptr + ex, mask=ex < E, other=0)
            used = (cnt > 0).to(tl.int32)
            pick = (tl.cumsum(used, axis=0) == t + 1) & (used > 0)
            e = tl.sum(tl.where(pick, ex, 0), axis=0)
            count = tl.sum(tl.where(pick, cnt, 0), axis=0)
        else:
            e = t
            count = tl.load(counts_ptr + e)
        return e, count

    # likewise: no specialization on the sizes that change every step
    @triton.jit(do_not_specialize=["cap"])
    def _expert_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, slots_ptr, counts_ptr, out_ptr, N,
                            K_DIM, cap, rows_per_a, stride_a, stride_as, stride_as_k,
                            stride_we, stride_wn, stride_out, E, stride_se, stride_sn, limit,
                            GATED: tl.constexpr, E_POW2: tl.constexpr, SCALED: tl.constexpr,
                            ACT_FP8: tl.constexpr, QUANT_A: tl.constexpr, UPCAST: tl.constexpr,
                            CLAMP: tl.constexpr, COMPACT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, K_PIECES: tl.constexpr):
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
        [-limit, limit] before SiLU(gate) * up."""
        PIECE: tl.constexpr = BLOCK_K // K_PIECES
        e, count = _program_expert(counts_ptr, E, E_POW2, COMPACT)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_gate = s_ptr + e.to(tl.int64) * stride_se + (tl.program_id(1) * BLOCK_N // 128) * \
            stride_sn
        s_up = s_gate + (N // 128) * stride_sn
        for m0 in range(0, count, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < count
            p = tl.load(slots_ptr + e * cap + offs_m, mask=m_ok, other=0).to(tl.int64)
            a_rows = a_ptr + (p // rows_per_a) * stride_a
            as_rows = as_ptr + (p // rows_per_a) * stride_as
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K_DIM, BLOCK_K):
                for j in tl.static_range(K_PIECES):
                    offs_k = k0 + j * PIECE + tl.arange(0, PIECE)
                    k_ok = offs_k < K_DIM
                    a = tl.load(a_rows[:, None] + offs_k[None, :],
                                mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    w_mask = k_ok[:, None] & n_ok[None, :]
                    w = tl.load(w_e + offs_n[None, :] * stride_wn + offs_k[:, None],
                                mask=w_mask, other=0.0)
                    if GATED:
                        u = tl.load(w_e + (N + offs_n)[None, :] * stride_wn + offs_k[:, None],
                                    mask=w_mask, other=0.0)
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
            if GATED:
                if CLAMP:
                    acc = tl.minimum(acc, limit)
                    acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            tl.store(out_ptr + p[:, None] * stride_out + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["cap"])
    def _expert_layer_kernel(x_ptr, xq_ptr, xs_ptr, w1_ptr, s1_ptr, w2_ptr, s2_ptr, slots_ptr,
                             counts_ptr, act_ptr, acts_ptr, y_ptr, H, I, cap, top_k, E,
                             stride_x, stride_xs, stride_xs_k, stride_w1e, stride_w1n,
                             stride_w2e, stride_w2n, stride_s1e, stride_s1n, stride_s2e,
                             stride_s2n, limit, E_POW2: tl.constexpr, SCALED: tl.constexpr,
                             ACT_FP8: tl.constexpr, QUANT_X: tl.constexpr,
                             UPCAST: tl.constexpr, CLAMP: tl.constexpr,
                             COMPACT: tl.constexpr, SPLIT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (t, s): expert e's (`_program_expert`) whole MLP on its slots, over the
        s-th of SPLIT ranges of its intermediate columns, in two phases:
        1. gate/up: for each BLOCK_I chunk of the range, every slot's row of x (slot p reads
           row p // top_k) times the chunk's gate and up rows, BLOCK_K inputs a step ->
           SiLU(gate) * up (CLAMP: DeepSeek-V4's clamp first), rounded to x's dtype as the
           two-GEMM path stores it, into act[p, chunk]; with ACT_FP8 quantized per row and
           chunk (BLOCK_I = 128: `quantize_act`'s groups) into act (FP8) and acts (scales).
        2. down: for each BLOCK_N columns of the output, act[p, range] times down's columns
           -> y[s, p, columns] in float32 (the sum over the range; `_slot_sum_kernel` adds
           the SPLIT ranges and the top-k slots).
        A barrier between the phases makes the act this program wrote visible to all its
        threads; no other program reads it. Each phase is one flat loop (chunk x step), so
        the weight tiles stream through one software pipeline. SCALED, ACT_FP8, UPCAST: as
        in `_expert_gemm_kernel` (one scale per 128 x 128 block, read per column); ACT_FP8
        with QUANT_X: the kernel quantizes x's rows itself, else it reads them quantized
        (`quantize_act`: xq, scales xs). x's dtype is the one act is rounded to."""
        e, count = _program_expert(counts_ptr, E, E_POW2, COMPACT)
        s = tl.program_id(1)
        chunks = tl.cdiv(I, BLOCK_I) // SPLIT  # the launch makes SPLIT divide the chunks
        c0 = s * chunks
        k_steps = tl.cdiv(H, BLOCK_K)
        n_steps = tl.cdiv(H, BLOCK_N)
        w1 = w1_ptr + e.to(tl.int64) * stride_w1e
        w2 = w2_ptr + e.to(tl.int64) * stride_w2e
        s1 = s1_ptr + e.to(tl.int64) * stride_s1e
        s2 = s2_ptr + e.to(tl.int64) * stride_s2e
        ii = tl.arange(0, BLOCK_I)
        for m0 in range(0, count, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < count
            p = tl.load(slots_ptr + e * cap + offs_m, mask=m_ok, other=0).to(tl.int64)
            if ACT_FP8 and not QUANT_X:
                x_rows = xq_ptr + (p // top_k) * stride_x
            else:
                x_rows = x_ptr + (p // top_k) * stride_x
            acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            for t in range(0, chunks * k_steps):
                step = t % k_steps
                cols = (c0 + t // k_steps) * BLOCK_I + ii
                i_ok = cols < I
                ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = ks < H
                a = tl.load(x_rows[:, None] + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                w_ok = k_ok[:, None] & i_ok[None, :]
                g = tl.load(w1 + cols[None, :] * stride_w1n + ks[:, None], mask=w_ok,
                            other=0.0)  # [BLOCK_K, BLOCK_I]
                u = tl.load(w1 + (I + cols)[None, :] * stride_w1n + ks[:, None], mask=w_ok,
                            other=0.0)
                if SCALED:
                    kb = step * BLOCK_K // 128
                    g_s = tl.load(s1 + (cols // 128) * stride_s1n + kb, mask=i_ok, other=0.0)
                    u_s = tl.load(s1 + ((I + cols) // 128) * stride_s1n + kb, mask=i_ok,
                                  other=0.0)
                if ACT_FP8:
                    if QUANT_X:
                        a, a_s = quantize_rows(a.to(tl.float32))
                    else:
                        a_s = tl.load(xs_ptr + (p // top_k) * stride_xs + kb * stride_xs_k,
                                      mask=m_ok, other=0.0)
                    if UPCAST:
                        a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
                    acc_g += tl.dot(a, g) * (a_s[:, None] * g_s[None, :])
                    acc_u += tl.dot(a, u) * (a_s[:, None] * u_s[None, :])
                elif SCALED:
                    acc_g += tl.dot(a, g.to(a.dtype)) * g_s[None, :]
                    acc_u += tl.dot(a, u.to(a.dtype)) * u_s[None, :]
                else:
                    acc_g = tl.dot(a, g, acc_g)
                    acc_u = tl.dot(a, u, acc_u)
                if step == k_steps - 1:  # the chunk's act
                    if CLAMP:
                        acc_g = tl.minimum(acc_g, limit)
                        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
                    act = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(
                        x_ptr.dtype.element_ty)
                    at = act_ptr + p[:, None] * I + cols[None, :]
                    if ACT_FP8:  # I is whole 128-column chunks
                        q, q_s = quantize_rows(act.to(tl.float32))
                        tl.store(at, q, mask=m_ok[:, None])
                        tl.store(acts_ptr + p * (I // 128) + (c0 + t // k_steps), q_s,
                                 mask=m_ok)
                    else:
                        tl.store(at, act, mask=m_ok[:, None] & i_ok[None, :])
                    acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
                    acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for t in range(0, n_steps * chunks):
                c = c0 + t % chunks
                outs = (t // chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
                n_ok = outs < H
                ks = c * BLOCK_I + ii
                k_ok = ks < I
                a = tl.load(act_ptr + p[:, None] * I + ks[None, :],
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w2 + outs[None, :] * stride_w2n + ks[:, None],
                            mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_I, BLOCK_N]
                if SCALED:
                    w_s = tl.load(s2 + (outs // 128) * stride_s2n + c * BLOCK_I // 128,
                                  mask=n_ok, other=0.0)
                if ACT_FP8:
                    a_s = tl.load(acts_ptr + p * (I // 128) + c, mask=m_ok, other=0.0)
                    if UPCAST:
                        a, w = a.to(tl.float32), w.to(tl.float32)
                    acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
                elif SCALED:
                    acc += tl.dot(a, w.to(a.dtype)) * w_s[None, :]
                else:
                    acc = tl.dot(a, w, acc)
                if t % chunks == chunks - 1:
                    tl.store(y_ptr + (s * cap + p)[:, None] * H + outs[None, :], acc,
                             mask=m_ok[:, None] & n_ok[None, :])
                    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
