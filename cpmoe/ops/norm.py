"""Norms, rotary embeddings and the K/V store: one Triton kernel each on CUDA, the torch
reference elsewhere.

- `norm_rope(x, weight, eps, cos, sin)`: per-head RMSNorm (optional) then rotary embedding
  of x [T, heads, D] (the Qwen3 q/k path). `norm_rope_fp8`: the same rows in e4m3 for FP8
  prefill attention, at a per-tensor scale the norm's weight bounds (no pass over the rows).
- `qkv_norm_rope_store(qkv, ...)`: the decode step's q/k/v in one pass over the fused QKV
  projection's rows: q and k through `norm_rope`, k and v written into the paged cache at
  their slots -> q. `to_kv_cache` / `kv_max`: how a K/V pool of a dtype stores a value.
  An FP8 pool stores x / scale (`kv_scale`: a layer's [4] float32 k_scale, v_scale,
  1 / k_scale, 1 / v_scale on the device, read by the kernel, so a CUDA graph keeps it);
  the store multiplies by the reciprocals: a product rounds alike in torch, Triton and its
  interpreter, a quotient need not.
- `add_rms_norm(x, residual, weight, eps)`: the residual add and the RMSNorm after it
  -> (norm(x + residual), x + residual), the sum rounded to x's dtype first (as two ops);
  optionally also the normed rows in FP8 for the GEMM after it (`quant_group`).
- `rms_norm_fp32_weight(x, weight, eps)`: RMSNorm with a float32 weight applied before the
  one rounding to x's dtype (DeepSeek-V4's norms).
"""

from __future__ import annotations

import functools
import math

import torch

from cpmoe.ops import launch
from cpmoe.ops.fp8 import FP8_MAX, offer_quantized
from cpmoe.ops.launch import pdl_args, tl, triton

if triton is not None:
    from cpmoe.ops.fp8 import quantize_rows
    from cpmoe.ops.launch import wait_for_producer


# ---- q/k norm + rotary -------------------------------------------------------------------

def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] with two equal halves (rotate-half convention)."""
    return _norm_rope_f32(x, weight, eps, cos, sin).to(x.dtype)


def _norm_rope_f32(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    if weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    if not launch.use_triton(x) or x.shape[0] == 0:
        return norm_rope_ref(x, weight, eps, cos, sin)
    T, heads, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    _norm_rope_kernel[(T,)](x, out, weight if weight is not None else x, cos, sin, out,
                            x.stride(0), eps, heads, HAS_NORM=weight is not None,
                            HEADS=triton.next_power_of_2(heads), HALF=D // 2)
    return out


def fp8_rope_bound(weight: torch.Tensor) -> torch.Tensor:
    """The largest magnitude `norm_rope` can write with this per-head RMSNorm weight [D]:
    max |w| sqrt(D) (float32, 1 where w is all 0). A normed head y = w x / rms(x) has
    |x_i| / rms(x) <= sqrt(D) (all of the head's energy in one input); the rotation mixes
    the pair (y_i, y_{i + D/2}), whose norm max |w| |(x_i, x_{i + D/2})| / rms(x) is within
    the same bound; rms(x) with eps only shrinks it."""
    bound = weight.float().abs().amax() * math.sqrt(weight.shape[0])
    return torch.where(bound > 0, bound, torch.ones_like(bound))


def norm_rope_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_rope` in float32, times s = 448 / `fp8_rope_bound`(weight), rounded once to
    e4m3 (nearest even) -> (codes [T, heads, D], descale 1 / s as a [1] float32 tensor)."""
    bound = fp8_rope_bound(weight)
    s = torch.tensor(FP8_MAX, device=bound.device) / bound
    y = _norm_rope_f32(x, weight, eps, cos, sin) * s
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), (bound / FP8_MAX).reshape(1)


def norm_rope_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_rope_fp8_ref` in `norm_rope`'s one pass: FP8 prefill attention's q
    (`cp.fp8_attention`, which takes the codes with their descale). Its per-tensor scale
    comes from the norm's weight, not from the rows: an amax scale needs the whole tensor
    read before any value is scaled (two more passes over q, the 16-bit q written and read
    back: 1.6 of the 69 ms of a 12-layer 16K FP8 prefill on an H100 at 57802a1). The bound
    is what the amax of adversarial rows would reach; on real rows it is larger than their
    amax, which moves values down the e4m3 scale, where every normal value keeps its 2^-4
    relative step: only values below 2^-6 of the bound's code range (y under max |w| sqrt(D)
    / 28,672) fall to subnormal steps."""
    T, heads, D = x.shape
    if not launch.use_triton(x) or T == 0:
        return norm_rope_fp8_ref(x, weight, eps, cos, sin)
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((T, heads, D), dtype=torch.float8_e4m3fn, device=x.device)
    descale = torch.empty(1, dtype=torch.float32, device=x.device)
    _norm_rope_kernel[(T,)](x, out, weight, cos, sin, descale, x.stride(0), eps, heads,
                            HAS_NORM=True, HEADS=triton.next_power_of_2(heads), HALF=D // 2,
                            FP8_OUT=True, SQRT_D=math.sqrt(D))
    return out, descale


def to_kv_cache(x: torch.Tensor, dtype: torch.dtype,
                inv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x as a K/V pool of `dtype` stores it: an FP8 pool (--kv-cache-dtype fp8_e4m3 /
    fp8_e5m2) holds x * inv_scale (1 / the checkpoint's k_scale or v_scale, a 0-d float32
    tensor; None: 1) saturated at the format's largest finite value, as the GPU's
    conversion does (torch's e5m2 cast would overflow to inf), rounded to nearest even. A
    16-bit pool holds x as it is (no scale)."""
    fmax = kv_max(dtype)
    if not fmax:
        return x.to(dtype)
    x = x.float() if inv_scale is None else x.float() * inv_scale
    return x.clamp(-fmax, fmax).to(dtype)


@functools.cache
def unit_kv_scale(device: torch.device) -> torch.Tensor:
    """The [4] K/V scales of a pool without a checkpoint's (all 1), one per device: what the
    kernels read when no scale is given."""
    return torch.ones(4, dtype=torch.float32, device=device)


def fill_kv_scale(kv_scale: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Set a layer's [4] K/V scales: k_scale, v_scale and their float32 reciprocals."""
    s = torch.tensor([k_scale, v_scale], dtype=torch.float32)
    kv_scale.copy_(torch.cat([s, 1.0 / s]))


def kv_max(dtype: torch.dtype) -> float:
    """The kernels' saturation bound for a K/V pool of `dtype` (0.0: a 16/32-bit pool)."""
    return torch.finfo(dtype).max if dtype.itemsize == 1 else 0.0


def qkv_norm_rope_store_ref(qkv: torch.Tensor, heads: int, kv_heads: int,
                            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                            eps: float, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D]; caches [pages, page, kv_heads, D]; slots [T] flat
    slot ids; kv_scale (FP8 pools) the layer's [4] scales (module docstring; None: 1).
    -> q [T, heads, D] after norm_rope; k (norm_rope'd) and v land in the caches."""
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q = norm_rope_ref(q.reshape(T, heads, D), q_weight, eps, cos, sin)
    k = norm_rope_ref(k.reshape(T, kv_heads, D), k_weight, eps, cos, sin)
    inv_k, inv_v = (None, None) if kv_scale is None else (kv_scale[2], kv_scale[3])
    k_cache.view(-1, kv_heads, D)[slots] = to_kv_cache(k, k_cache.dtype, inv_k)
    v_cache.view(-1, kv_heads, D)[slots] = to_kv_cache(v.reshape(T, kv_heads, D),
                                                       v_cache.dtype, inv_v)
    return q


def qkv_norm_rope_store(qkv: torch.Tensor, heads: int, kv_heads: int,
                        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """See qkv_norm_rope_store_ref; one Triton program per row on CUDA."""
    if not _store_kernel_fits(qkv, q_weight, k_weight, k_cache, v_cache):
        return qkv_norm_rope_store_ref(qkv, heads, kv_heads, q_weight, k_weight, eps, cos,
                                       sin, k_cache, v_cache, slots, kv_scale)
    return _store(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, k_cache, v_cache,
                  slots, kv_scale, False)[0]


def qkv_norm_rope_store_fp8_ref(qkv: torch.Tensor, heads: int, kv_heads: int,
                                q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slots: torch.Tensor,
                                kv_scale: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope_store_ref` with q as `norm_rope_fp8_ref` writes it -> (codes,
    descale)."""
    qkv_norm_rope_store_ref(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, k_cache,
                            v_cache, slots, kv_scale)
    D = k_cache.shape[-1]
    return norm_rope_fp8_ref(qkv[:, :heads * D].reshape(qkv.shape[0], heads, D), q_weight,
                             eps, cos, sin)


def qkv_norm_rope_store_fp8(qkv: torch.Tensor, heads: int, kv_heads: int,
                            q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slots: torch.Tensor,
                            kv_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope_store` writing q in e4m3 at `norm_rope_fp8`'s weight-bound scale, for
    FP8 prefill attention over a served chunk -> (codes [T, heads, D], descale [1])."""
    if not _store_kernel_fits(qkv, q_weight, k_weight, k_cache, v_cache):
        return qkv_norm_rope_store_fp8_ref(qkv, heads, kv_heads, q_weight, k_weight, eps, cos,
                                           sin, k_cache, v_cache, slots, kv_scale)
    return _store(qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin, k_cache, v_cache,
                  slots, kv_scale, True)


def _store_kernel_fits(qkv: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> bool:
    return (launch.use_triton(qkv) and qkv.shape[0] > 0
            and (q_weight is None) == (k_weight is None)
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def _store(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor | None,
           k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           kv_scale: torch.Tensor | None, fp8_q: bool
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (q, its descale where fp8_q, else None)."""
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((T, heads, D), dtype=torch.float8_e4m3fn if fp8_q else qkv.dtype,
                    device=qkv.device)
    descale = torch.empty(1, dtype=torch.float32, device=qkv.device) if fp8_q else None
    _qkv_norm_rope_store_kernel[(T,)](
        qkv, q, q_weight if q_weight is not None else qkv,
        k_weight if k_weight is not None else qkv, cos, sin, k_cache, v_cache, slots,
        kv_scale if kv_scale is not None else unit_kv_scale(qkv.device),
        descale if fp8_q else q,  # any pointer when q is 16-bit
        qkv.stride(0), eps, heads, kv_heads, HAS_NORM=q_weight is not None,
        HEADS=triton.next_power_of_2(heads), KV_HEADS=triton.next_power_of_2(kv_heads),
        HALF=D // 2, KV_MAX=kv_max(k_cache.dtype), FP8_Q=fp8_q, SQRT_D=math.sqrt(D),
        **pdl_args(qkv))
    return q, descale


# ---- residual add + RMSNorm ----------------------------------------------------------

def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weight * normalized(x + residual), x + residual); the sum in x's dtype."""
    r = residual + x
    rf = r.float()
    rf = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * rf.to(x.dtype), r


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, quant_group: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref in one pass (one Triton program per row) on CUDA. quant_group (a
    power of two dividing the row): the pass also quantizes the normed rows to FP8 per
    1 x quant_group, as `quantize_act` does, and offers them to it
    (`fp8.offer_quantized`: the FP8 GEMM reading these rows next launches no
    quantization of its own); another group quantizes nothing."""
    if not launch.use_triton(x) or x.shape[0] == 0 or x.dim() != 2:
        return add_rms_norm_ref(x, residual, weight, eps)
    x, residual = x.contiguous(), residual.contiguous()
    n, hidden = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    quant = (quant_group is not None and hidden % quant_group == 0
             and quant_group & (quant_group - 1) == 0)  # groups tile the row's power of two
    q = s_t = out  # any pointer when not quantizing
    if quant:
        q = torch.empty(n, hidden, dtype=torch.float8_e4m3fn, device=x.device)
        s_t = torch.empty(hidden // quant_group, n, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(n,)](x, residual, weight, out, summed, q, s_t, n, hidden, eps,
                               BLOCK=block, QUANT=quant,
                               GROUP=quant_group if quant else block, **pdl_args(x))
    if quant:
        offer_quantized(out, q, s_t.t(), quant_group)
    return out, summed


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(weight * x / rms(x)) with a float32 weight, rounded once to x's dtype (DeepSeek-V4's
    RMSNorm, `layers.RMSNorm`), one Triton program per row of x [..., N]: x read once, the
    result written once (the torch expression writes a float32 copy, its square, the normed
    copy, the weighted copy and the rounded result)."""
    N = x.shape[-1]
    if weight.shape != (N,) or weight.dtype != torch.float32:
        raise ValueError(f"rms_norm_fp32_weight: need a float32 weight [{N}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    rows = x.reshape(-1, N)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] and N:
        _rms_norm_fp32w_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), N, eps,
                                                  BLOCK=triton.next_power_of_2(N),
                                                  num_warps=8 if N >= 4096 else 4)
    return out.view(x.shape)



if triton is not None:
    _E4M3_MAX = tl.constexpr(FP8_MAX)

    @triton.jit
    def _rms_norm_fp32w_kernel(x_ptr, w_ptr, out_ptr, x_st, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * x_st + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * N + cols, (w * (x * rstd)).to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _rope_heads(src, w_ptr, cos_ptr, sin_ptr, t, eps, d, mask,
                    HAS_NORM: tl.constexpr, HALF: tl.constexpr):
        """Heads at src + h * 2 HALF + d (h [heads, 1], d [1, HALF]) -> rotated halves."""
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
            r = (1.0 / tl.sqrt(ms + eps))[:, None]
            x1 = x1 * r * tl.load(w_ptr + d).to(tl.float32)
            x2 = x2 * r * tl.load(w_ptr + HALF + d).to(tl.float32)
        c = tl.load(cos_ptr + t * (2 * HALF) + d).to(tl.float32)
        s = tl.load(sin_ptr + t * (2 * HALF) + d).to(tl.float32)
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def _norm_rope_kernel(x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, descale_ptr, x_row_stride,
                          eps, heads, HAS_NORM: tl.constexpr, HEADS: tl.constexpr,
                          HALF: tl.constexpr, FP8_OUT: tl.constexpr = False,
                          SQRT_D: tl.constexpr = 1.0):
        """FP8_OUT: out is e4m3, the rows times 448 / (max |w| SQRT_D) (`norm_rope_fp8`),
        every program computing that scale from w alike; program 0 writes its descale."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = h < heads
        a, b = _rope_heads(x_ptr + t * x_row_stride + h * (2 * HALF) + d, w_ptr, cos_ptr,
                           sin_ptr, t, eps, d, mask, HAS_NORM, HALF)
        dst = out_ptr + t * heads * (2 * HALF) + h * (2 * HALF) + d
        if FP8_OUT:
            a, b = _e4m3_at_bound(a, b, w_ptr, descale_ptr, t, HALF, SQRT_D)
        tl.store(dst, a.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, b.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _e4m3_at_bound(a, b, w_ptr, descale_ptr, t, HALF: tl.constexpr,
                       SQRT_D: tl.constexpr):
        """A row's rotated halves (float32) -> their e4m3 codes at 448 / (max |w| SQRT_D)
        (`norm_rope_fp8`), row 0 writing the descale."""
        w = tl.abs(tl.load(w_ptr + tl.arange(0, 2 * HALF)).to(tl.float32))
        bound = tl.max(w, axis=0) * SQRT_D
        bound = tl.where(bound > 0, bound, 1.0)
        s = tl.math.div_rn(_E4M3_MAX + tl.zeros_like(bound), bound)
        a = tl.clamp(a * s, -_E4M3_MAX, _E4M3_MAX).to(tl.float8e4nv,
                                                       fp_downcast_rounding="rtne")
        b = tl.clamp(b * s, -_E4M3_MAX, _E4M3_MAX).to(tl.float8e4nv,
                                                       fp_downcast_rounding="rtne")
        if t == 0:
            tl.store(descale_ptr, tl.math.div_rn(bound, _E4M3_MAX + tl.zeros_like(bound)))
        return a, b

    @triton.jit
    def _to_kv(x, qkv_ptr, pool_ptr, inv_scale, KV_MAX: tl.constexpr):
        """x rounded to the model's dtype (qkv's), then to the pool's (`to_kv_cache`: FP8
        pools x * inv_scale)."""
        x = x.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        if KV_MAX > 0:
            x = tl.clamp(x * inv_scale, -KV_MAX, KV_MAX)
        return x.to(pool_ptr.dtype.element_ty)

    @triton.jit
    def _qkv_norm_rope_store_kernel(qkv_ptr, q_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                                    k_cache_ptr, v_cache_ptr, slots_ptr, scale_ptr,
                                    descale_ptr, row_stride, eps,
                                    heads, kv_heads, HAS_NORM: tl.constexpr,
                                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                                    HALF: tl.constexpr, KV_MAX: tl.constexpr = 0.0,
                                    FP8_Q: tl.constexpr = False, SQRT_D: tl.constexpr = 1.0,
                                    PDL: tl.constexpr = False):
        """KV_MAX > 0: FP8 pools; k and v, rounded to qkv's dtype first (as the torch path
        rounds them), times 1 / k_scale and 1 / v_scale (scale_ptr[2:4]), saturate at
        +-KV_MAX (`to_kv_cache`). FP8_Q: q in e4m3 (`qkv_norm_rope_store_fp8`)."""
        wait_for_producer(PDL)
        inv_k = tl.load(scale_ptr + 2)  # used by FP8 pools only
        inv_v = tl.load(scale_ptr + 3)
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF)[None, :]
        row = qkv_ptr + t * row_stride
        # q: norm + rope -> q_ptr [T, heads, D]
        h = tl.arange(0, HEADS)[:, None]
        mask = h < heads
        a, b = _rope_heads(row + h * (2 * HALF) + d, qw_ptr, cos_ptr, sin_ptr, t, eps, d,
                           mask, HAS_NORM, HALF)
        dst = q_ptr + t * heads * (2 * HALF) + h * (2 * HALF) + d
        if FP8_Q:
            a, b = _e4m3_at_bound(a, b, qw_ptr, descale_ptr, t, HALF, SQRT_D)
        tl.store(dst, a.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, b.to(q_ptr.dtype.element_ty), mask=mask)
        # k: norm + rope -> the cache slot; v: copied to its slot
        slot = tl.load(slots_ptr + t).to(tl.int64)
        g = tl.arange(0, KV_HEADS)[:, None]
        kv_mask = g < kv_heads
        k_src = row + heads * (2 * HALF) + g * (2 * HALF) + d
        a, b = _rope_heads(k_src, kw_ptr, cos_ptr, sin_ptr, t, eps, d, kv_mask, HAS_NORM,
                           HALF)
        k_dst = k_cache_ptr + slot * kv_heads * (2 * HALF) + g * (2 * HALF) + d
        tl.store(k_dst, _to_kv(a, qkv_ptr, k_cache_ptr, inv_k, KV_MAX), mask=kv_mask)
        tl.store(k_dst + HALF, _to_kv(b, qkv_ptr, k_cache_ptr, inv_k, KV_MAX), mask=kv_mask)
        v_src = k_src + kv_heads * (2 * HALF)
        v_dst = v_cache_ptr + slot * kv_heads * (2 * HALF) + g * (2 * HALF) + d
        tl.store(v_dst, _to_kv(tl.load(v_src, mask=kv_mask, other=0.0), qkv_ptr, v_cache_ptr,
                               inv_v, KV_MAX), mask=kv_mask)
        tl.store(v_dst + HALF, _to_kv(tl.load(v_src + HALF, mask=kv_mask, other=0.0),
                                      qkv_ptr, v_cache_ptr, inv_v, KV_MAX), mask=kv_mask)


    @triton.jit(do_not_specialize=["n_rows"])
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, q_ptr, s_ptr, n_rows,
                             hidden, eps, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                             GROUP: tl.constexpr, PDL: tl.constexpr = False):
        """QUANT: the normed row, once written, read back as [BLOCK / GROUP, GROUP] groups
        and quantized (`quantize_rows`) into q [n_rows, hidden] and its scales
        s [hidden / GROUP, n_rows]. Read back, not reshaped: a reshape lets the compiler
        lay out the whole row anew, which reorders the sum of squares (at c6507ec the
        normed values then differed from the plain pass's by a bf16 step at times)."""
        wait_for_producer(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        s = (r + x).to(sum_ptr.dtype.element_ty)  # rounded as the separate add rounds it
        tl.store(sum_ptr + row * hidden + cols, s, mask=mask)
        sf = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / hidden + eps)
        y = (sf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, (w * y).to(out_ptr.dtype.element_ty),
                 mask=mask)
        if QUANT:
            tl.debug_barrier()  # the row's stores, by every thread, before any reads it
            g = tl.arange(0, BLOCK // GROUP)
            at = row * hidden + g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            in_row = (g < hidden // GROUP)[:, None]
            q, scale = quantize_rows(tl.load(out_ptr + at, mask=in_row, other=0.0).to(
                tl.float32))
            tl.store(q_ptr + at, q, mask=in_row)
            tl.store(s_ptr + g * n_rows + row, scale, mask=g < hidden // GROUP)
