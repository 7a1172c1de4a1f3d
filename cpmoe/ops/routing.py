"""The Qwen router: fp32 softmax over the experts' logits, the k largest (descending; ties to
the lower id), optionally renormalised -> (ids int64, weights in dtype).

- `softmax_topk(logits, ...)`: after the router's matmul (prefill's rows, where the matmul
  is a GEMM of its own).
- `router_softmax_topk(x, weight, ...)`: `softmax_topk(F.linear(x, weight), ...)` for few
  rows (decode), the matmul and the top-k in one kernel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from cpmoe.ops import launch
from cpmoe.ops.launch import pdl_args, tl, triton

if triton is not None:
    from cpmoe.ops.launch import wait_for_producer


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
    if not launch.use_triton(logits) or N == 0 or k > E:
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


# A decode step's router: [M, H] rows times the [E, H] weight, then `softmax_topk`. As two
# launches on the H200 (1d2b62c, batch 64, Qwen3-30B-A3B: H 2048, E 128) cuBLAS took 5.4 us
# for 64 x 128 logits and the top-k 3.0 us, a layer. One kernel does both: programs
# (16-row block, K range) each read one 128-column slice of the weight, a tile of every
# expert, and write their partial logits; the last program of a row block (an atomic count)
# sums the block's partials in split order, rounds them to x's dtype as F.linear does, and
# takes the top-k. The sum's order is fixed, so the ids do not depend on which program came
# last. $CPMOE_FUSED_ROUTER=0 keeps the two launches (for A/B runs of a whole step).
FUSED_ROUTER = os.environ.get("CPMOE_FUSED_ROUTER", "1") != "0"
FUSED_ROUTER_MAX_ROWS = 256  # decode batches; prefill's rows take the GEMM
_ROUTER_BLOCK_M = 16  # tl.dot's least
_ROUTER_SPLITS = 16  # K ranges: a wave of programs at batch 64 reads the weight once
# Triton's interpreter returns garbage from tl.dot on bf16 operands: there the dots take
# the same values in float32 (exact products, as the tensor cores' are)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def router_softmax_topk(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk(F.linear(x, weight), k, renormalize, dtype): in one kernel for up to
    FUSED_ROUTER_MAX_ROWS rows of a 16-bit x on CUDA (any dtype in the interpreter), else
    the two ops."""
    N, H = x.shape
    E = weight.shape[0]
    m_blocks = triton.cdiv(N, _ROUTER_BLOCK_M) if _fusable(x, weight, k) else 0
    counters = launch.arrival_counts(x.device, "router", m_blocks) if m_blocks else None
    if counters is None:
        return softmax_topk(F.linear(x, weight), k, renormalize, dtype)
    block_k = min(128, triton.next_power_of_2(H))
    tiles = triton.cdiv(H, block_k)
    per_split = triton.cdiv(tiles, min(_ROUTER_SPLITS, tiles)) * block_k  # whole tiles
    splits = triton.cdiv(H, per_split)
    e_pow2 = triton.next_power_of_2(E)
    x, weight = x.contiguous(), weight.contiguous()
    partial = torch.empty(splits, m_blocks * _ROUTER_BLOCK_M, e_pow2, dtype=torch.float32,
                          device=x.device)
    ids = torch.empty((N, k), dtype=torch.int64, device=x.device)
    weights = torch.empty((N, k), dtype=dtype, device=x.device)
    _router_topk_kernel[(m_blocks, splits)](
        x, weight, partial, counters, ids, weights, N, H, E, per_split, SPLITS=splits, K=k,
        RENORM=renormalize, BLOCK_M=_ROUTER_BLOCK_M, BLOCK_K=block_k, E_POW2=e_pow2,
        K_POW2=triton.next_power_of_2(k), UPCAST=_INTERPRET, num_warps=4, **pdl_args(x))
    return ids, weights


def _fusable(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    if not (FUSED_ROUTER and launch.use_triton(x)) or x.dim() != 2:
        return False
    N, H = x.shape
    E = weight.shape[0]
    if not 0 < N <= FUSED_ROUTER_MAX_ROWS or k > E or E > 256 or weight.dtype != x.dtype:
        return False
    # on CUDA a 16-bit x (tl.dot rounds float32 to TF32; the interpreter computes in float32)
    return not x.is_cuda or x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit
    def _softmax_topk_rows(x, rows, ok, cols, E, ids_ptr, w_ptr, K: tl.constexpr,
                           RENORM: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr):
        """Rows of float32 logits x [BLOCK, E_POW2] (padding columns and rows -inf; `ok` the
        real rows) -> their top-k ids and weights stored at ids_ptr / w_ptr ([N, K])."""
        valid = ok[:, None] & (cols[None, :] < E)
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        p = tl.where(valid, p, -1.0)  # padding columns never win
        picked = tl.zeros([x.shape[0]], dtype=tl.float32)
        k_cols = tl.arange(0, K_POW2)
        out_w = tl.zeros([x.shape[0], K_POW2], dtype=tl.float32)
        out_i = tl.zeros([x.shape[0], K_POW2], dtype=tl.int64)
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

    # likewise: no specialization on the sizes that change every step
    @triton.jit(do_not_specialize=["N"])
    def _softmax_topk_kernel(logits_ptr, ids_ptr, w_ptr, N, E, K: tl.constexpr,
                             RENORM: tl.constexpr, BLOCK: tl.constexpr, E_POW2: tl.constexpr,
                             K_POW2: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_producer(PDL)
        rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, E_POW2)
        ok = rows < N
        x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :],
                    mask=ok[:, None] & (cols[None, :] < E), other=float("-inf")).to(tl.float32)
        _softmax_topk_rows(x, rows, ok, cols, E, ids_ptr, w_ptr, K, RENORM, E_POW2, K_POW2)

    @triton.jit(do_not_specialize=["N"])
    def _router_topk_kernel(x_ptr, w_ptr, part_ptr, count_ptr, ids_ptr, wout_ptr, N, H, E,
                            PER_SPLIT, SPLITS: tl.constexpr, K: tl.constexpr,
                            RENORM: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                            E_POW2: tl.constexpr, K_POW2: tl.constexpr,
                            UPCAST: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (row block mb, K range s): partial logits of rows mb over columns
        [s * PER_SPLIT, (s + 1) * PER_SPLIT) -> part[s, rows, :]; the block's last program
        to arrive sums part[0..SPLITS-1] and takes the top-k (`_softmax_topk_rows`)."""
        wait_for_producer(PDL)
        mb = tl.program_id(0)
        s = tl.program_id(1)
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = rows < N
        e = tl.arange(0, E_POW2)
        e_ok = e < E
        c = tl.arange(0, BLOCK_K)
        lo = s * PER_SPLIT
        hi = tl.minimum(lo + PER_SPLIT, H)
        acc = tl.zeros([BLOCK_M, E_POW2], dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK_K):
            col = k0 + c
            c_ok = col < hi
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * H + col[None, :],
                        mask=ok[:, None] & c_ok[None, :], other=0.0)
            w = tl.load(w_ptr + e[None, :].to(tl.int64) * H + col[:, None],
                        mask=c_ok[:, None] & e_ok[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        tile = rows[:, None] * E_POW2 + e[None, :]  # part: [SPLITS, blocks * BLOCK_M, E_POW2]
        plane = tl.num_programs(0) * BLOCK_M * E_POW2
        tl.store(part_ptr + s * plane + tile, acc)
        # every thread's stores before the count (a release by one thread covers what the
        # program's barrier ordered before it): the last program then reads them all
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + mb, 1, sem="acq_rel") == SPLITS - 1:
            logits = tl.zeros([BLOCK_M, E_POW2], dtype=tl.float32)
            # in split order, whoever arrived last; unrolled, so the loads are all issued
            # before the first sum waits (L2 reads: .cg, never an SM's stale L1 line)
            for i in tl.static_range(SPLITS):
                logits += tl.load(part_ptr + i * plane + tile, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + mb, 0)  # for the next launch
            # F.linear's output dtype, then fp32 for the softmax (as the two ops round)
            logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
            logits = tl.where(ok[:, None] & e_ok[None, :], logits, float("-inf"))
            _softmax_topk_rows(logits, rows.to(tl.int64), ok, e, E, ids_ptr, wout_ptr, K,
                               RENORM, E_POW2, K_POW2)
