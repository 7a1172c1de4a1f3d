"""Fused elementwise ops of the model: one Triton kernel each on CUDA, the plain torch
expression (the reference the kernels are tested against) everywhere else.

- `silu_and_mul(h)`: SwiGLU of gate/up rows packed as [.., 2I] (gate first) -> [.., I].
- `clamped_swiglu(gate, up, limit)`: DeepSeek-V4's SwiGLU with clamped inputs.
- `rms_norm_fp32_weight(x, weight, eps)`: RMSNorm with a float32 weight applied before the
  one rounding to x's dtype (DeepSeek-V4's norms).
- `weighted_row_sum(y, index, weight)`: out[m] = sum_k weight[m, k] * y[index[m, k]]
  (the MoE combine: every row's weighted sum of its top-k expert outputs).
- `norm_rope(x, weight, eps, cos, sin)`: per-head RMSNorm (optional) then rotary embedding
  of x [T, heads, D] (the Qwen3 q/k path).
- `qkv_norm_rope_store(qkv, ...)`: the decode step's q/k/v in one pass over the fused QKV
  projection's rows: q and k through `norm_rope`, k and v written into the paged cache at
  their slots -> q.
- `add_rms_norm(x, residual, weight, eps)`: the residual add and the RMSNorm after it
  -> (norm(x + residual), x + residual), the sum rounded to x's dtype first (as two ops);
  optionally also the normed rows in FP8 for the GEMM after it (`quant_group`).
- `quantize_rows(x)` (in kernels): a float32 tile's rows -> FP8 per row and their scales,
  the arithmetic of `quant.kernels.quantize_act`, for every kernel that quantizes.
- `softmax_topk(logits, k, renormalize, dtype)`: the Qwen router after its matmul: fp32
  softmax over experts, the k largest (descending; ties to the lower id), optionally
  renormalised -> (ids int64, weights in dtype).
- `pdl_args(x)` and `wait_for_producer(PDL)` (in kernels): programmatic dependent launch,
  for the kernels of a decode step (see `pdl_args`).
- `merge_partials(o, lse)`: P partial attention outputs over disjoint keys [P, T, H, D] with
  their log-sum-exps [P, T, H] -> the exact result, fp32 (o = sum_i exp(lse_i - lse) * o_i,
  lse = logsumexp_i(lse_i); a part that saw no key, lse -inf, weighs zero).
  `merge_two_attention(o1, lse1, o2, lse2, out)` is its P = 2 case written into out (CP
  prefill: a query run's own keys and the keys before it).

Kernels accumulate in fp32 and round once. Triton is optional: without it (or on CPU) the
torch expressions run. Legend: T/M rows, H hidden, K top-k, I intermediate, D head dim.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from cpmoe._triton import import_triton
from cpmoe.quant.formats import INV_FP8_MAX
from cpmoe.quant.offers import offer_quantized

triton, tl = import_triton()  # None on CPU-only torch without the interpreter


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ---- programmatic dependent launch ------------------------------------------------------

def pdl_args(x: torch.Tensor) -> dict:
    """Launch arguments of a kernel that starts with `wait_for_producer`: on a Hopper or newer
    GPU {"PDL": True, "launch_pdl": True}, else {"PDL": False}. Launched so (programmatic
    dependent launch), the kernel's programs may be placed on the SMs while the kernel
    before it in the stream still runs (once that one's programs have all passed their own
    wait) and start the moment it completes: the launch and its ramp overlap the tail of the
    kernel before. Graph capture keeps the dependency. On the H200 at Qwen3-30B-A3B's shape
    (bench-one-batch, uniform routing, input 1,024, 91a246a) a decode step took 3.53 ms
    against 3.73 at batch 1 in bf16 and 3.19 against 3.48 in FP8; at batch 64, which reads
    weights for most of its time, 17.18 against 17.37 and 12.02 against 12.03. Programs that
    also asked L2 for their first weight lines before the wait were no faster and were
    dropped. $CPMOE_PDL=0 turns it off (`PDL_ENABLED`, read at import; its ranks inherit
    it)."""
    if PDL_ENABLED and x.is_cuda and _pdl_device(x.device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


# read once: pdl_args runs at every launch of an eager decode step (~600 a step)
PDL_ENABLED = os.environ.get("CPMOE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int | None) -> bool:
    """Hopper or newer NVIDIA GPU, and a Triton that has grid dependency control."""
    if getattr(torch.version, "hip", None) is not None or triton is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    major = torch.cuda.get_device_capability(index)[0]
    return (major >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
            and "launch_pdl" in CUDAOptions.__dataclass_fields__)


# ---- SwiGLU ----------------------------------------------------------------------------

def silu_and_mul_ref(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's SwiGLU: SiLU(min(gate, limit)) * clamp(up, -limit, limit). On CUDA in
    16 bits one kernel pass (the torch expression makes four: two clamps, the SiLU and the
    product, ~4 GB of traffic per MoE layer at 16K tokens); elsewhere the expression."""
    if (gate.is_cuda and gate.dtype in (torch.bfloat16, torch.float16) and gate.dim() == 2
            and _use_triton(gate)):
        return clamped_swiglu_triton(gate, up, limit)
    return clamped_swiglu_ref(gate, up, limit)


def clamped_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`clamped_swiglu_ref` in one pass: gate and up [M, I] (any row strides, e.g. the two
    halves of packed [M, 2I] rows), SiLU and product in fp32, rounded once -> new [M, I]."""
    if gate.shape != up.shape or gate.dim() != 2 or up.dtype != gate.dtype:
        raise ValueError(f"clamped_swiglu: need gate and up [M, I] of one dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype}, {tuple(up.shape)} {up.dtype}")
    return _swiglu(gate, up, limit)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    if not _use_triton(h) or h.shape[0] == 0:
        return silu_and_mul_ref(h)
    return _swiglu(*h.contiguous().chunk(2, dim=-1), None)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) * up of [M, I] rows (inputs clamped first when limit is given), one
    Triton pass -> new [M, I]."""
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    n, inter = gate.shape
    out = gate.new_empty((n, inter))
    if n == 0 or inter == 0:
        return out
    block = 1024
    _swiglu_kernel[(n, triton.cdiv(inter, block))](
        gate, up, out, gate.stride(0), up.stride(0), inter, 0.0 if limit is None else limit,
        CLAMP=limit is not None, BLOCK=block)
    return out


# ---- MoE combine -----------------------------------------------------------------------

def weighted_row_sum_ref(y: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
                         ) -> torch.Tensor:
    """out[m] = sum_k weight[m, k] * y[index[m, k]]; a zero weight reads nothing (its row may
    be memory no GEMM wrote, NaN included), as in the kernel."""
    M, K = index.shape
    w = weight.flatten().float()[:, None]
    rows = torch.where(w != 0, y[index.flatten()].float() * w, 0.0)
    return rows.view(M, K, -1).sum(dim=1).to(y.dtype)


def weighted_row_sum(y: torch.Tensor, index: torch.Tensor, weight: torch.Tensor
                     ) -> torch.Tensor:
    if not _use_triton(y) or index.shape[0] == 0:
        return weighted_row_sum_ref(y, index, weight)
    y, index, weight = y.contiguous(), index.contiguous(), weight.contiguous()
    M, K = index.shape
    H = y.shape[1]
    out = y.new_empty((M, H))
    block = min(1024, triton.next_power_of_2(H))
    _weighted_row_sum_kernel[(M, triton.cdiv(H, block))](y, index, weight, out, H, K=K,
                                                         BLOCK=block)
    return out


# ---- q/k norm + rotary -------------------------------------------------------------------

def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] with two equal halves (rotate-half convention)."""
    xf = x.float()
    if weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    if not _use_triton(x) or x.shape[0] == 0:
        return norm_rope_ref(x, weight, eps, cos, sin)
    T, heads, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    _norm_rope_kernel[(T,)](x, out, weight if weight is not None else x, cos, sin,
                            x.stride(0), eps, heads, HAS_NORM=weight is not None,
                            HEADS=triton.next_power_of_2(heads), HALF=D // 2)
    return out


def to_kv_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a K/V pool of `dtype` stores it: an FP8 pool (--kv-cache-dtype fp8_e4m3 /
    fp8_e5m2, scale 1) saturates at the format's largest finite value, as the GPU's
    conversion does (torch's e5m2 cast would overflow to inf), and rounds to nearest even."""
    fmax = kv_max(dtype)
    return x.float().clamp(-fmax, fmax).to(dtype) if fmax else x.to(dtype)


def kv_max(dtype: torch.dtype) -> float:
    """The kernels' saturation bound for a K/V pool of `dtype` (0.0: a 16/32-bit pool)."""
    return torch.finfo(dtype).max if dtype.itemsize == 1 else 0.0


def qkv_norm_rope_store_ref(qkv: torch.Tensor, heads: int, kv_heads: int,
                            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                            eps: float, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
                            ) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D]; caches [pages, page, kv_heads, D]; slots [T] flat
    slot ids. -> q [T, heads, D] after norm_rope; k (norm_rope'd) and v land in the caches."""
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q = norm_rope_ref(q.reshape(T, heads, D), q_weight, eps, cos, sin)
    k = norm_rope_ref(k.reshape(T, kv_heads, D), k_weight, eps, cos, sin)
    k_cache.view(-1, kv_heads, D)[slots] = to_kv_cache(k, k_cache.dtype)
    v_cache.view(-1, kv_heads, D)[slots] = to_kv_cache(v.reshape(T, kv_heads, D), v_cache.dtype)
    return q


def qkv_norm_rope_store(qkv: torch.Tensor, heads: int, kv_heads: int,
                        q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
                        ) -> torch.Tensor:
    """See qkv_norm_rope_store_ref; one Triton program per row on CUDA."""
    T = qkv.shape[0]
    D = k_cache.shape[-1]
    if (not _use_triton(qkv) or T == 0 or (q_weight is None) != (k_weight is None)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return qkv_norm_rope_store_ref(qkv, heads, kv_heads, q_weight, k_weight, eps, cos,
                                       sin, k_cache, v_cache, slots)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((T, heads, D), dtype=qkv.dtype, device=qkv.device)
    _qkv_norm_rope_store_kernel[(T,)](
        qkv, q, q_weight if q_weight is not None else qkv,
        k_weight if k_weight is not None else qkv, cos, sin, k_cache, v_cache, slots,
        qkv.stride(0), eps, heads, kv_heads, HAS_NORM=q_weight is not None,
        HEADS=triton.next_power_of_2(heads), KV_HEADS=triton.next_power_of_2(kv_heads),
        HALF=D // 2, KV_MAX=kv_max(k_cache.dtype), **pdl_args(qkv))
    return q


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
    (`quant.offers.offer_quantized`: the FP8 GEMM reading these rows next launches no
    quantization of its own); another group quantizes nothing."""
    if not _use_triton(x) or x.shape[0] == 0 or x.dim() != 2:
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


# ---- router: softmax + top-k ---------------------------------------------------------

def softmax_topk_ref(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk_ref in one pass over the logits [N, E] (torch's top-k alone took 0.5 ms
    for 64K rows of 128 experts on an H200)."""
    N, E = logits.shape
    if not _use_triton(logits) or N == 0 or k > E:
        return softmax_topk_ref(logits, k, renormalize, dtype)
    logits = logits.contiguous()
    ids = torch.empty((N, k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((N, k), dtype=dtype, device=logits.device)
    block = 16
    _softmax_topk_kernel[(triton.cdiv(N, block),)](logits, ids, weights, N, E, K=k,
                                                    RENORM=renormalize, BLOCK=block,
                                                    E_POW2=triton.next_power_of_2(E),
                                                    K_POW2=triton.next_power_of_2(k),
                                                    **pdl_args(logits))
    return ids, weights


# ---- merge of two partial attention results ---------------------------------------------

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
    if (not _use_triton(o1) or T == 0 or D & (D - 1) or o1.stride(2) != 1
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
    _INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)

    @triton.jit
    def wait_for_producer(PDL: tl.constexpr):
        """The first statement of a kernel launched with `pdl_args`: with PDL, wait until the
        kernel before it in the stream has completed and its writes are visible (nothing of
        this kernel reads or writes global memory before), then let the kernel after it be
        placed. Kernels that wait first in every program keep the stream's order: each
        completes only after the one before it."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

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

    # likewise: no specialization on the sizes that change every step
    @triton.jit(do_not_specialize=["N"])
    def _softmax_topk_kernel(logits_ptr, ids_ptr, w_ptr, N, E, K: tl.constexpr,
                             RENORM: tl.constexpr, BLOCK: tl.constexpr, E_POW2: tl.constexpr,
                             K_POW2: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_producer(PDL)
        rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, E_POW2)
        ok = rows < N
        valid = ok[:, None] & (cols[None, :] < E)
        x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=valid,
                    other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        p = tl.where(valid, p, -1.0)  # padding columns never win
        picked = tl.zeros([BLOCK], dtype=tl.float32)
        k_cols = tl.arange(0, K_POW2)
        out_w = tl.zeros([BLOCK, K_POW2], dtype=tl.float32)
        out_i = tl.zeros([BLOCK, K_POW2], dtype=tl.int64)
        for k in tl.static_range(K):
            best = tl.max(p, axis=1)
            # the lowest column holding the maximum
            idx = tl.min(tl.where(p == best[:, None], cols[None, :], E_POW2), axis=1)
            out_w = tl.where(k_cols[None, :] == k, best[:, None], out_w)
            out_i = tl.where(k_cols[None, :] == k, idx[:, None].to(tl.int64), out_i)
            picked += best
            p = tl.where(cols[None, :] == idx[:, None], -1.0, p)
        if RENORM:
            out_w = out_w / picked[:, None]
        dst = rows[:, None] * K + k_cols[None, :]
        keep = ok[:, None] & (k_cols[None, :] < K)
        tl.store(ids_ptr + dst, out_i, mask=keep)
        tl.store(w_ptr + dst, out_w.to(w_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def swiglu_act(gate, up, limit, CLAMP: tl.constexpr):
        """SiLU(gate) * up of float32 tiles, the inputs clamped first with CLAMP
        (`clamped_swiglu_ref`'s bounds): the one expression of every SwiGLU kernel, so
        their results agree bit for bit."""
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, g_st, u_st, inter, limit,
                       CLAMP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gate_ptr + row * g_st + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * u_st + cols, mask=mask, other=0.0).to(tl.float32)
        act = swiglu_act(gate, up, limit, CLAMP)
        tl.store(out_ptr + row * inter + cols, act.to(out_ptr.dtype.element_ty), mask=mask)

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
    def _weighted_row_sum_kernel(y_ptr, index_ptr, weight_ptr, out_ptr, hidden,
                                 K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            src = tl.load(index_ptr + row * K + k).to(tl.int64)
            w = tl.load(weight_ptr + row * K + k).to(tl.float32)
            # a zero weight (a slot of another EP rank's expert) reads nothing
            used = mask & ((tl.zeros([BLOCK], dtype=tl.float32) + w) != 0.0)
            vals = tl.load(y_ptr + src * hidden + cols, mask=used, other=0.0)
            acc += w * vals.to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

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
    def _norm_rope_kernel(x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, x_row_stride, eps,
                          heads, HAS_NORM: tl.constexpr, HEADS: tl.constexpr,
                          HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, HALF)[None, :]
        mask = h < heads
        a, b = _rope_heads(x_ptr + t * x_row_stride + h * (2 * HALF) + d, w_ptr, cos_ptr,
                           sin_ptr, t, eps, d, mask, HAS_NORM, HALF)
        dst = out_ptr + t * heads * (2 * HALF) + h * (2 * HALF) + d
        tl.store(dst, a.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, b.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _to_kv(x, q_ptr, pool_ptr, KV_MAX: tl.constexpr):
        """x rounded to q's dtype, then to the pool's (`to_kv_cache`)."""
        x = x.to(q_ptr.dtype.element_ty).to(tl.float32)
        if KV_MAX > 0:
            x = tl.clamp(x, -KV_MAX, KV_MAX)
        return x.to(pool_ptr.dtype.element_ty)

    @triton.jit
    def _qkv_norm_rope_store_kernel(qkv_ptr, q_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                                    k_cache_ptr, v_cache_ptr, slots_ptr, row_stride, eps,
                                    heads, kv_heads, HAS_NORM: tl.constexpr,
                                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                                    HALF: tl.constexpr, KV_MAX: tl.constexpr = 0.0,
                                    PDL: tl.constexpr = False):
        """KV_MAX > 0: FP8 pools; k and v, rounded to q's dtype first (as the torch path
        rounds them), saturate at +-KV_MAX (`to_kv_cache`)."""
        wait_for_producer(PDL)
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, HALF)[None, :]
        row = qkv_ptr + t * row_stride
        # q: norm + rope -> q_ptr [T, heads, D]
        h = tl.arange(0, HEADS)[:, None]
        mask = h < heads
        a, b = _rope_heads(row + h * (2 * HALF) + d, qw_ptr, cos_ptr, sin_ptr, t, eps, d,
                           mask, HAS_NORM, HALF)
        dst = q_ptr + t * heads * (2 * HALF) + h * (2 * HALF) + d
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
        tl.store(k_dst, _to_kv(a, q_ptr, k_cache_ptr, KV_MAX), mask=kv_mask)
        tl.store(k_dst + HALF, _to_kv(b, q_ptr, k_cache_ptr, KV_MAX), mask=kv_mask)
        v_src = k_src + kv_heads * (2 * HALF)
        v_dst = v_cache_ptr + slot * kv_heads * (2 * HALF) + g * (2 * HALF) + d
        tl.store(v_dst, _to_kv(tl.load(v_src, mask=kv_mask, other=0.0), q_ptr, v_cache_ptr,
                               KV_MAX), mask=kv_mask)
        tl.store(v_dst + HALF, _to_kv(tl.load(v_src + HALF, mask=kv_mask, other=0.0), q_ptr,
                                      v_cache_ptr, KV_MAX), mask=kv_mask)


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
