"""DeepSeek-V4's hyper-connection stream arithmetic as Triton kernels: each reads the hc
streams once and writes its result once, accumulating in float32.

    hc_merge(h_TcH, out_TH, post_Tc, comb_Tcc) -> h'_TcH
        h'[t, j] = post[t, j] * out[t] + sum_i comb[t, i, j] * h[t, i]
    hc_collapse(h_TcH, pre_Tc) -> x_TH
        x[t] = sum_i pre[t, i] * h[t, i]
    hc_mix(h_TcH, fn_NK, eps) -> mix_TN
        mix[t] = (fn @ flat h[t]) * r[t], r[t] = rsqrt(mean over c, H of h[t]^2 + eps),
        K = c H: the hyper-connection's float32 mix of the RMS-normed streams (the norm's
        scale applied after the linear)
    hc_weights(mix_TN, scale_3, base_N, iters, eps) -> (pre_Tc, post_Tc, comb_Tcc)
        the mix's split into the collapse weights pre, the spread weights post and the
        Sinkhorn-projected stream mixing comb (`DeepseekV4HyperConnection.weights`)

Legend: T rows, c = hc streams, H hidden.

Why: in a 4-layer V4 prefill of 16K tokens on an H200 (bf16, 284 ms of CUDA time), the
torch merge's `torch.matmul(comb^T, h)` ran as a generic batched GEMM (T batches of 4 x 4
times 4 x H), 5 ms a call and 40.3 ms over the 8 merges, where reading h and out and
writing h' takes about 0.25 ms of HBM time; the collapse wrote a float32 [T, c, H] product
before summing it, and `_flat_rms` a float32 copy of h (1 GB at 16K), then its square and
the normed copy. Later (219 ms profile) the mix still wrote a float32 copy of h (1 GiB at
16K) for cuBLAS's float32 GEMM (0.56 ms a call): ~1 ms for each of its 9 mixes, where
reading h takes ~0.13 ms; `hc_mix` reads h once in its own dtype for the linear and the
norm. The Sinkhorn projection of comb ran ~120 launches of tiny [T, c, c] elementwise ops
per hyper-connection (a few us each); `hc_weights` is one launch.

Accuracy: merge and collapse form their sums in float32 from the 16-bit streams and the
float32 weights and round once to h's dtype. The torch merge rounds post and comb to h's
dtype, then each of its two terms and their sum, so the kernel is the more accurate of the
two; the torch collapse also rounds once. hc_mix sums squares in float32; its products
take tl.dot with 3 TF32 passes (a 16-bit h is exact in TF32; fn splits into two TF32 parts,
~22 bits) accumulated in float32, IEEE float32 dots in the interpreter.

Inputs: h [T, c, H] (bf16/fp16 on the GPU, float32 for the interpreter tests), out [T, H]
in h's dtype, last dims contiguous, other strides free; post, pre [T, c] and comb
[T, c, c] float32, any strides. Outputs are new contiguous tensors. c is a power of two
(V4's hc_mult is 4); T only sizes the grid and is not specialized on, so decode (under CUDA
graphs too: nothing reads a value to the host) and prefill share each compiled variant.
"""

from __future__ import annotations

import os

import torch

from cpmoe._triton import import_triton

triton, tl = import_triton()

# Defaults for c = 4 from `python3 -m bench.v4_hyper_connection --lengths 16384 --sweep` on
# the H200 (bench/results/v4-hc-sweep-1f85a85.log): a merge program holds [4 rows, 4
# streams, 256] float32 (32 registers a thread at 4 warps) and writes 4 x 4 x 256 outputs;
# merge and collapse run at 3.8-4.0 TB/s, each within 3% of its sweep's best.
BLOCK_T, BLOCK_H, NUM_WARPS = 4, 256, 4
# hc_mix from 8192 rows (prefill): [64 rows, 32] float32 tiles of h, a [32, 32] tile of fn
# (N = 24 padded), a [64, 32] float32 accumulator; 256 programs at 16K rows. The sweep's
# fastest: 0.509 ms at 16K rows (1.05 TB/s; the HBM floor is 0.11 ms), where 32 x 64 took
# 0.920 ms. Fewer rows (decode) keep 32 x 64, unswept: 64-row tiles would halve their few
# programs.
MIX_TILES, MIX_TILES_FEW, MIX_MANY_ROWS = (64, 32), (32, 64), 8192
WEIGHTS_BLOCK_T = 64  # hc_weights: [64, 4, 4] float32 comb tiles, 256 programs at 16K


def _check_streams(name: str, h: torch.Tensor, weights: dict[str, tuple[torch.Tensor, int]]
                   ) -> tuple[int, int, int]:
    """Shape/dtype/layout checks only (no value is read, so no host sync) -> (T, hc, H).
    `weights`: name -> (float32 tensor, its number of dims: [T, hc] or [T, hc, hc])."""
    if h.dim() != 3 or h.stride(2) != 1:
        raise ValueError(f"{name}: need h [T, hc, H] with a contiguous last axis, got "
                         f"{tuple(h.shape)} strides {h.stride()}")
    T, c, H = h.shape
    if c & (c - 1):
        raise ValueError(f"{name}: hc must be a power of two, got {c}")
    for key, (w, dims) in weights.items():
        want = (T, c, c)[:dims]
        if tuple(w.shape) != want or w.dtype != torch.float32:
            raise ValueError(f"{name}: need {key} float32 {want}, got {w.dtype} "
                             f"{tuple(w.shape)}")
    return T, c, H


def hc_merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             block_t: int = BLOCK_T, block_h: int = BLOCK_H,
             num_warps: int = NUM_WARPS) -> torch.Tensor:
    """See the module docstring -> h' [T, hc, H] in h's dtype. The tile sizes and warps are
    for the benchmark's sweeps (powers of two)."""
    T, c, H = _check_streams("hc_merge", h, {"post": (post, 2), "comb": (comb, 3)})
    if out.shape != (T, H) or out.dtype != h.dtype or out.stride(1) != 1:
        raise ValueError(f"hc_merge: need out {h.dtype} {(T, H)} with a contiguous last "
                         f"axis, got {out.dtype} {tuple(out.shape)}")
    if triton is None:
        raise RuntimeError("hc_merge needs Triton (on CUDA or its interpreter)")
    new = torch.empty(T, c, H, dtype=h.dtype, device=h.device)
    if T == 0:
        return new
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    _merge_kernel[grid](
        h, out, post, comb, new, h.stride(0), h.stride(1), out.stride(0), post.stride(0),
        post.stride(1), comb.stride(0), comb.stride(1), comb.stride(2), T, H, HC=c,
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps)
    return new


def hc_collapse(h: torch.Tensor, pre: torch.Tensor, block_t: int = BLOCK_T,
                block_h: int = BLOCK_H, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """See the module docstring -> x [T, H] in h's dtype."""
    T, c, H = _check_streams("hc_collapse", h, {"pre": (pre, 2)})
    if triton is None:
        raise RuntimeError("hc_collapse needs Triton (on CUDA or its interpreter)")
    x = torch.empty(T, H, dtype=h.dtype, device=h.device)
    if T == 0:
        return x
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    _collapse_kernel[grid](h, pre, x, h.stride(0), h.stride(1), pre.stride(0), pre.stride(1),
                           T, H, HC=c, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps)
    return x


def hc_mix(h: torch.Tensor, fn: torch.Tensor, eps: float, block_t: int | None = None,
           block_k: int | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """See the module docstring -> mix [T, N] float32. h's rows must be flat ([T, c, H] with
    the streams adjacent, as hc_merge writes them); fn [N, c H] float32, last dim
    contiguous. Tiles default to MIX_TILES from MIX_MANY_ROWS rows, else MIX_TILES_FEW."""
    T, c, H = _check_streams("hc_mix", h, {})
    if h.stride(1) != H or fn.dim() != 2 or fn.shape[1] != c * H or fn.stride(1) != 1 \
            or fn.dtype != torch.float32:
        raise ValueError(f"hc_mix: need flat h rows and fn float32 [N, {c * H}] with a "
                         f"contiguous last axis, got h strides {h.stride()}, fn {fn.dtype} "
                         f"{tuple(fn.shape)}")
    if triton is None:
        raise RuntimeError("hc_mix needs Triton (on CUDA or its interpreter)")
    N = fn.shape[0]
    tiles = MIX_TILES if T >= MIX_MANY_ROWS else MIX_TILES_FEW
    block_t, block_k = block_t or tiles[0], block_k or tiles[1]
    mix = torch.empty(T, N, dtype=torch.float32, device=h.device)
    if T == 0:
        return mix
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _mix_kernel[(triton.cdiv(T, block_t),)](
        h, fn, mix, h.stride(0), fn.stride(0), T, c * H, N, eps, BLOCK_T=block_t,
        BLOCK_K=block_k, N_PAD=max(16, triton.next_power_of_2(N)),
        PRECISION="ieee" if interpreted else "tf32x3", num_warps=num_warps)
    return mix


def hc_weights(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
               eps: float, block_t: int = WEIGHTS_BLOCK_T
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring: mix [T, (2 + c) c] float32 (last dim contiguous), scale [3],
    base [(2 + c) c] float32 -> new float32 pre [T, c], post [T, c], comb [T, c, c]."""
    T, N = mix.shape
    c = int(round((1 + N) ** 0.5)) - 1  # N = (2 + c) c
    if (2 + c) * c != N or c & (c - 1) or mix.stride(1) != 1 or mix.dtype != torch.float32:
        raise ValueError(f"hc_weights: need mix float32 [T, (2 + hc) hc] with hc a power of "
                         f"two and a contiguous last axis, got {mix.dtype} {tuple(mix.shape)}")
    if scale.shape != (3,) or base.shape != (N,):
        raise ValueError(f"hc_weights: need scale [3] and base [{N}], got "
                         f"{tuple(scale.shape)} and {tuple(base.shape)}")
    if triton is None:
        raise RuntimeError("hc_weights needs Triton (on CUDA or its interpreter)")
    pre = torch.empty(T, c, dtype=torch.float32, device=mix.device)
    post = torch.empty(T, c, dtype=torch.float32, device=mix.device)
    comb = torch.empty(T, c, c, dtype=torch.float32, device=mix.device)
    if T:
        _weights_kernel[(triton.cdiv(T, block_t),)](
            mix, scale, base, pre, post, comb, mix.stride(0), T, iters, eps, HC=c,
            BLOCK_T=block_t)
    return pre, post, comb


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _weights_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, m_st, T,
                        iters, eps, HC: tl.constexpr, BLOCK_T: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        t64 = t.to(tl.int64)
        i = tl.arange(0, HC)
        rows = mix_ptr + t64[:, None] * m_st
        ok2 = t_ok[:, None]
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
        pre = tl.load(rows + i[None, :], mask=ok2, other=0.0) * s_pre + tl.load(base_ptr + i)
        pre = tl.sigmoid(pre) + eps
        tl.store(pre_ptr + t64[:, None] * HC + i[None, :], pre, mask=ok2)
        post = (tl.load(rows + HC + i[None, :], mask=ok2, other=0.0) * s_post
                + tl.load(base_ptr + HC + i))
        tl.store(post_ptr + t64[:, None] * HC + i[None, :], 2 * tl.sigmoid(post), mask=ok2)
        ij = i[:, None] * HC + i[None, :]  # [HC, HC]: row i, column j
        ok3 = t_ok[:, None, None]
        x = (tl.load(rows[:, :, None] + 2 * HC + ij[None, :, :], mask=ok3, other=0.0) * s_comb
             + tl.load(base_ptr + 2 * HC + ij)[None, :, :])
        x = tl.exp(x - tl.max(x, axis=2)[:, :, None])
        comb = x / tl.sum(x, axis=2)[:, :, None] + eps  # softmax over j
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)  # rows
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
        tl.store(comb_ptr + t64[:, None, None] * (HC * HC) + ij[None, :, :], comb, mask=ok3)

    @triton.jit(do_not_specialize=["T"])
    def _mix_kernel(h_ptr, fn_ptr, mix_ptr, h_st, fn_sn, T, K, N, eps, BLOCK_T: tl.constexpr,
                    BLOCK_K: tl.constexpr, N_PAD: tl.constexpr, PRECISION: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        n = tl.arange(0, N_PAD)
        t_ok, n_ok = t < T, n < N
        rows = h_ptr + t.to(tl.int64)[:, None] * h_st
        acc = tl.zeros([BLOCK_T, N_PAD], dtype=tl.float32)
        sq = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(rows + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            x = x.to(tl.float32)  # [BLOCK_T, BLOCK_K]
            w = tl.load(fn_ptr + n[None, :] * fn_sn + k[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, N_PAD]
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            sq += tl.sum(x * x, axis=1)
        r = 1.0 / tl.sqrt(sq / K + eps)
        tl.store(mix_ptr + t.to(tl.int64)[:, None] * N + n[None, :], acc * r[:, None],
                 mask=t_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _streams(h_ptr, h_st, h_sc, t64, h_off, ok, HC: tl.constexpr):
        """The [BLOCK_T, HC, BLOCK_H] tile of h at rows t64, columns h_off, in float32."""
        i = tl.arange(0, HC)
        ptrs = (h_ptr + t64[:, None, None] * h_st + i[None, :, None] * h_sc
                + h_off[None, None, :])
        return tl.load(ptrs, mask=ok[:, None, :], other=0.0).to(tl.float32)

    @triton.jit(do_not_specialize=["T"])
    def _merge_kernel(h_ptr, o_ptr, post_ptr, comb_ptr, new_ptr, h_st, h_sc, o_st, p_st, p_sc,
                      c_st, c_si, c_sj, T, H, HC: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_H: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        t_ok = t < T
        ok = t_ok[:, None] & (col < H)[None, :]
        t64 = t.to(tl.int64)
        hs = _streams(h_ptr, h_st, h_sc, t64, col, ok, HC)  # [BLOCK_T, HC, BLOCK_H]
        o = tl.load(o_ptr + t64[:, None] * o_st + col[None, :], mask=ok, other=0.0)
        o = o.to(tl.float32)
        i = tl.arange(0, HC)
        for j in tl.static_range(HC):
            cj = tl.load(comb_ptr + t64[:, None] * c_st + i[None, :] * c_si + j * c_sj,
                         mask=t_ok[:, None], other=0.0)  # comb[t, :, j]
            pj = tl.load(post_ptr + t64 * p_st + j * p_sc, mask=t_ok, other=0.0)
            acc = tl.sum(cj[:, :, None] * hs, axis=1) + pj[:, None] * o
            tl.store(new_ptr + t64[:, None] * (HC * H) + j * H + col[None, :],
                     acc.to(new_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["T"])
    def _collapse_kernel(h_ptr, pre_ptr, x_ptr, h_st, h_sc, p_st, p_sc, T, H,
                         HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        t_ok = t < T
        ok = t_ok[:, None] & (col < H)[None, :]
        t64 = t.to(tl.int64)
        hs = _streams(h_ptr, h_st, h_sc, t64, col, ok, HC)
        i = tl.arange(0, HC)
        pre = tl.load(pre_ptr + t64[:, None] * p_st + i[None, :] * p_sc, mask=t_ok[:, None],
                      other=0.0)
        x = tl.sum(pre[:, :, None] * hs, axis=1)
        tl.store(x_ptr + t64[:, None] * H + col[None, :], x.to(x_ptr.dtype.element_ty),
                 mask=ok)
