"""FP8: block-scaled formats, the activations' per-group quantization, and rows a kernel
quantized as it wrote them. Everything FP8 computes with rests on this module.

Formats (`dequantize`, `quantize_block_fp8`, `scale_grid`, ...):

- Block FP8 (HF `X.weight_scale_inv`, DeepSeek-V4 `X.scale`): q float8_e4m3fn [N, K] and
  s [ceil(N/bn), ceil(K/bk)] (float32, or ue8m0 = float8_e8m0fnu / raw bytes, 2^(byte-127));
  W = q * s on each [bn, bk] block; the last block of a dim may be partial.
- MXFP4 (DeepSeek-V4 routed experts): e2m1 values packed two per byte [N, K/2] (low nibble
  the even input, high nibble the odd one; int8, uint8 or float4_e2m1fn_x2), one ue8m0
  scale per 32 inputs [N, K/32]: a block of [1, 32].

A slice of a weight is dequantized from the slice of the scale grid covering it; `offset`
says where the weight slice starts inside its first block (0 on block-aligned cuts).

Activations:
- `quantize_act(x, group)`: x [M, K] -> (q float8_e4m3fn [M, K], s float32 [M, K/group]),
  s = amax(group) / 448 per row and group of `group` inputs (the "1x128" activation recipe).
  Rows a kernel quantized as it wrote them come back as they are (below).
- `quantize_rows` (in kernels): a float32 tile's rows -> FP8 per row and their scales, the
  same arithmetic, for every kernel that quantizes (add_rms_norm, the GEMMs, decode
  attention's merge).
- `swiglu_quantize(h, group, limit)`: `quantize_act(silu_and_mul(h), group)` (or of the
  clamped SwiGLU) in one pass, for the FP8 experts' down GEMM.

Offers (`offer_quantized`, `offered`):

A kernel that writes activations an FP8 GEMM reads next (the RMSNorm before q/k/v and before
the experts, decode attention's split merge before o_proj) can quantize them in the same pass
and offer the result: `offer_quantized(x, q, s, group)`; FP8 prefill attention, whose O
cuDNN writes in e4m3, offers those codes and leaves x unwritten. `quantize_act` of those
rows then returns (q, s) instead of launching (`offered`). One offer is held at a time: each
producer's rows are consumed before the next producer runs.
"""

from __future__ import annotations

import weakref

import torch

from cpmoe.ops import launch
from cpmoe.ops.launch import pdl_args, tl, triton

if triton is not None:
    from cpmoe.ops.activation import swiglu_act
    from cpmoe.ops.launch import wait_for_producer

# ---- formats ---------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# 1 / 448 rounded to float32 (a Python float holding that value): activation scales are
# amax times it, in `quantize_act_ref` and in the kernels alike
INV_FP8_MAX = float(torch.tensor(1.0) / torch.tensor(FP8_MAX))
MXFP4_BLOCK = (1, 32)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_DTYPES = {torch.int8, torch.uint8} | ({torch.float4_e2m1fn_x2}
                                         if hasattr(torch, "float4_e2m1fn_x2") else set())
# safetensors dtype names of checkpoint tensors
FP8_NAMES = {"F8_E4M3"}
FP4_NAMES = {"I8", "U8", "F4", "F4_E2M1", "F4_E2M1FN_X2"}
UE8M0_NAMES = {"F8_E8M0", "U8"}


def is_packed_fp4(dtype: torch.dtype) -> bool:
    return dtype in _FP4_DTYPES


def scale_to_float(s: torch.Tensor) -> torch.Tensor:
    """A scale grid in float32: ue8m0 bytes are 2^(byte - 127) (byte 255 is NaN)."""
    if s.dtype in (torch.float8_e8m0fnu, torch.uint8):
        e = s.view(torch.uint8).to(torch.float32)
        return torch.where(e == 255, torch.nan, torch.exp2(e - 127.0))
    return s.to(torch.float32)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[.., K/2] packed e2m1 -> float32 [.., K]."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    pairs = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 in [0, 16)) [.., K] -> uint8 [.., K/2] (even input low)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def expand_scale(s: torch.Tensor, shape: tuple[int, int], block: tuple[int, int],
                 offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Per-element float32 scales [shape] of a weight slice starting at `offset` inside the
    first block of the scale grid `s`."""
    full = scale_to_float(s).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
               offset: tuple[int, int] = (0, 0), dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """W = q * s: a [N, K] FP8 (or [N, K/2] packed MXFP4) slice -> dtype [N, K]."""
    values = unpack_fp4(q) if is_packed_fp4(q.dtype) else q.to(torch.float32)
    w = values * expand_scale(s, tuple(values.shape), block, offset)
    return w.to(dtype)


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (q float8_e4m3fn [N, K], s float32 [ceil(N/bn), ceil(K/bk)]) with
    s = amax(block) / 448, so every block's largest value maps to +-448 (all-zero blocks
    get s = 1)."""
    N, K = w.shape
    bn, bk = block
    gn, gk = scale_grid((N, K), block)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(gn * bn, gk * bk)[:N, :K].contiguous(), s


# ---- rows offered by the kernel that wrote them -------------------------------------------

_OFFER: list[tuple] = []  # [(weakref to the tensor owning the rows, key of the rows, q, s)]


def offer_quantized(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> None:
    """x [M, K] quantized per 1 x `group` (q, s [M, K/group] with strides (1, M)): as
    quantize_act would, or, where the producer's own output is FP8 (prefill attention's O,
    `cp.attention._runs_fp8_offered`), its codes and scales, x itself then left unwritten
    for the GEMM to read through the offer alone. The offer holds while x's memory is alive
    and unwritten by torch (a kernel writing through a raw pointer bumps no version: offer
    fresh outputs only)."""
    owner = x if x._base is None else x._base
    _OFFER[:] = [(weakref.ref(owner), _rows_key(x, group), q, s)]


def offered(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The offer for these rows, if any: the same memory (its owner alive, so not reused),
    viewed the same way, not written since (views share one version counter)."""
    if not _OFFER:
        return None
    owner, key, q, s = _OFFER[0]
    if owner() is None:
        _OFFER.clear()
        return None
    return (q, s) if _rows_key(x, group) == key else None


def _rows_key(x: torch.Tensor, group: int) -> tuple:
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x._version, group)


# ---- activation quantization ------------------------------------------------------------

def quantize_act_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    g = x.float().view(M, K // group, group)
    # times the float32 reciprocal, not "/ 448": what the kernels compute, exactly, on any
    # device (torch's CUDA division by a scalar multiplies by its reciprocal anyway)
    s = (g.abs().amax(dim=-1) * INV_FP8_MAX).clamp(min=1e-12)
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # IEEE division
    return q.view(M, K), s


def quantize_config(M: int) -> dict:
    """Tile of `_quantize_act_kernel` for M rows: BLOCK_M rows x one group a program, and
    its warps. Decode (1-64 rows) is launch-bound whatever the tile, and one row a program
    keeps its few hundred programs spread over the SMs; prefill (16K-128K rows) wants
    programs big enough to hide memory latency: 32 rows x 128 bf16 inputs are 8 KB, 16-byte
    loads, 32 inputs a thread. Between, the tile grows with the rows. bench/fp8_quantize.py
    on the H200 (bench/results/fp8-quantize-6127e2f.log): 32 rows on 4 warps is the fastest
    at 16K x 2048 and within 3% of the best at the other prefill shapes (3.0-4.25 TB/s);
    at decode's shapes every tile takes the same ~23-29 us, the launch."""
    block_m = 1
    while block_m < 32 and block_m * 512 < M:
        block_m *= 2
    return {"BLOCK_M": block_m, "num_warps": 1 if block_m == 1 else 4}


def quantize_act(x: torch.Tensor, group: int = 128, rows: int | None = None,
                 config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales come back [M, K/group] with strides (1, M) (column-major), the layout
    scaled_mm's BlockWise1x128 recipe reads; values are the same either way. rows >= M:
    both padded to that many rows with zeros (values and scales; an offer's by a copy).
    config: `quantize_config`'s keys (bench/fp8_quantize.py sweeps them)."""
    M, K = x.shape
    if K % group:
        raise ValueError(f"FP8 activations: {K} inputs are not a multiple of the group {group}")
    rows = M if rows is None else rows
    taken = offered(x, group)
    if taken is not None:
        return taken if rows == M else _pad_rows(*taken, rows)
    if not launch.use_triton(x) or M == 0:
        return _pad_rows(*quantize_act_ref(x, group), rows)
    x = x.contiguous()
    q = torch.empty(rows, K, dtype=FP8, device=x.device)
    s_t = torch.empty(K // group, rows, dtype=torch.float32, device=x.device)
    cfg = config or quantize_config(M)
    groups = K // group
    grid = (triton.cdiv(rows, cfg["BLOCK_M"]) * groups,)
    _quantize_act_kernel[grid](x, q, s_t, M, rows, K, GROUP=group, **cfg, **pdl_args(x))
    return q, s_t.t()



def _pad_rows(q: torch.Tensor, s: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, K] FP8 and s [M, K/group] -> both with zero rows up to `rows` (byte 0 is e4m3's
    0), s column-major: `quantize_act`'s padding, as its kernel writes it."""
    M, K = q.shape
    padded_q = torch.zeros(rows, K, dtype=torch.uint8, device=q.device)
    padded_q[:M].copy_(q.view(torch.uint8))
    padded_s = torch.zeros(s.shape[1], rows, dtype=s.dtype, device=s.device)
    padded_s[:, :M].copy_(s.t())
    return padded_q.view(q.dtype), padded_s.t()


if triton is not None:
    _INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)

    @triton.jit
    def quantize_rows(x):
        """A tile's rows [R, group] (float32) -> (e4m3 values, float32 scales [R]) with
        `quantize_act`'s arithmetic: amax / 448 per row, rounded to nearest even. For GEMM
        kernels that quantize the rows they read (no launch of their own). The scale is
        amax times the float32 reciprocal of 448, as `quantize_act_ref` computes it; the
        values divide with `div_rn`, IEEE-rounded as torch's tensor division is: Triton's
        `/` on fp32 is the GPU's approximate division, off by an ulp at times, which moved
        values across FP8 rounding boundaries (tests/gpu/test_fp8_cuda.py, bit for bit,
        failed at 6127e2f)."""
        s = tl.maximum(tl.max(tl.abs(x), axis=1) * _INV_FP8_MAX, 1e-12)
        q = tl.clamp(tl.math.div_rn(x, s[:, None]), -448.0, 448.0).to(
            tl.float8e4nv, fp_downcast_rounding="rtne")
        return q, s

    # M, R: sizes that change every step: no specialization on them (Triton would compile a
    # new variant, ~1 s, for each new residue mod 16 it meets while serving)
    @triton.jit(do_not_specialize=["M", "R"])
    def _quantize_act_kernel(x_ptr, q_ptr, s_ptr, M, R, K, GROUP: tl.constexpr,
                             BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
        """Program p: rows [BLOCK_M * (p // groups), ..) x group p % groups (neighbouring
        programs read neighbouring groups of the same rows). Rows in [M, R) are padding:
        values and scales 0 (their inputs read as 0, so x / s is 0)."""
        wait_for_producer(PDL)
        groups = K // GROUP
        pid = tl.program_id(0)
        g = pid % groups
        rows = (pid // groups) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = g * GROUP + tl.arange(0, GROUP)
        offs = rows[:, None].to(tl.int64) * K + cols[None, :]
        x = tl.load(x_ptr + offs, mask=(rows < M)[:, None], other=0.0).to(tl.float32)
        q, s = quantize_rows(x)
        tl.store(q_ptr + offs, q, mask=(rows < R)[:, None])
        # scales stored [K/group, R]: column-major [R, K/group]
        tl.store(s_ptr + g * R + rows, tl.where(rows < M, s, 0.0), mask=rows < R)


def swiglu_quantize_fits(h: torch.Tensor, group: int) -> bool:
    """Whether `swiglu_quantize` takes packed gate/up rows h [P, 2I] here."""
    return (launch.use_triton(h) and h.dim() == 2 and h.shape[0] > 0
            and h.shape[1] % (2 * group) == 0)


def swiglu_quantize(h: torch.Tensor, group: int = 128, limit: float | None = None,
                    config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_act(silu_and_mul(h), group)` in one pass (with limit: of DeepSeek-V4's
    `clamped_swiglu`), the SwiGLU never written out: h [P, 2I] (gate first) -> (e4m3
    [P, I], float32 scales [P, I/group] with strides (1, P)). Bit for bit the two Triton
    kernels' result: the SwiGLU has their expression in float32 and is rounded to h's dtype
    before it is quantized, as the unfused path stores it. config: `quantize_config`'s."""
    if not swiglu_quantize_fits(h, group):
        raise ValueError(f"swiglu_quantize: need [P > 0, 2I] rows, I a multiple of {group}, "
                         f"on CUDA or the interpreter; got {tuple(h.shape)} on {h.device}")
    h = h if h.stride(1) == 1 else h.contiguous()
    P, inter = h.shape[0], h.shape[1] // 2
    q = torch.empty(P, inter, dtype=FP8, device=h.device)
    s_t = torch.empty(inter // group, P, dtype=torch.float32, device=h.device)
    cfg = config or quantize_config(P)
    grid = (triton.cdiv(P, cfg["BLOCK_M"]) * (inter // group),)
    _swiglu_quantize_kernel[grid](h, q, s_t, P, inter, h.stride(0),
                                  0.0 if limit is None else limit, GROUP=group,
                                  CLAMP=limit is not None, **cfg)
    return q, s_t.t()



if triton is not None:

    @triton.jit(do_not_specialize=["P"])  # the slots: a size that changes every step
    def _swiglu_quantize_kernel(h_ptr, q_ptr, s_ptr, P, inter, h_st, limit,
                                GROUP: tl.constexpr, CLAMP: tl.constexpr,
                                BLOCK_M: tl.constexpr):
        """Program p: rows [BLOCK_M * (p // groups), ..) x output group p % groups, as in
        `_quantize_act_kernel`; the SwiGLU is `activation.swiglu_act`, as in the SwiGLU kernel."""
        groups = inter // GROUP
        pid = tl.program_id(0)
        g = pid % groups
        rows = (pid // groups) * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = (rows < P)[:, None]
        cols = g * GROUP + tl.arange(0, GROUP)
        at = h_ptr + rows[:, None].to(tl.int64) * h_st + cols[None, :]
        gate = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(at + inter, mask=ok, other=0.0).to(tl.float32)
        act = swiglu_act(gate, up, limit, CLAMP)
        # rounded as the unfused path stores it, so the scales and values are the same
        act = act.to(h_ptr.dtype.element_ty).to(tl.float32)
        q, s = quantize_rows(act)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], q, mask=ok)
        tl.store(s_ptr + g * P + rows, s, mask=rows < P)  # [I/group, P]: column-major
