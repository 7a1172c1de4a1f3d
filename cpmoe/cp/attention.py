"""Attention math for CP prefill and sharded-KV decode (no communication here).

- `prefill_attention`: this rank's queries (its CP chunk, any order within a sequence)
  against the full K/V of their sequences in original order, causal on global positions.
- `partial_attention`: queries against one KV shard, returning output and log-sum-exp
  (natural log, fp32) so shards can be merged (`ops.merge_partials`); a query that sees no
  key gets lse = -inf.
- `chunk_attention_with_lse`: `prefill_attention` with the log-sum-exp too (a chunk of a
  long prompt, to be merged with its attention over the cached prefix).
- `prefix_partial`: queries of several sequences against this rank's shard of each one's
  cached prefix (every cached key precedes every query: no mask).
- `PackedRuns` / `PackedPrefix`: the host-built metadata that lets CUDA run either of the
  last two for every sequence of a step in one varlen flash-attention launch per layer
  (`varlen_attention`) instead of a few launches per sequence.

Legend: T = local query tokens, N = keys, H = local query heads, Hkv = local KV heads,
D = head dim. GQA: query head h reads KV head h // (H / Hkv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cpmoe import ops
from cpmoe.cp.kv_cache import pool_rows, widen_kv
from cpmoe.ops import launch
from cpmoe.ops.fp8 import offer_quantized

# Rows of queries processed at once: bounds the [H, rows, keys] mask/score memory.
_QUERY_CHUNK = 1024
# CUDA prefill without a cached prefix: up to this many runs, cuDNN per run (about twice
# flash's speed on long runs); beyond, one varlen flash launch for all (launches dominate)
_RUNS_PER_LAUNCH = 16
# ... and only when every run has at least this many queries: cuDNN builds an execution
# plan for each new run length, 46-59 ms of host time on the H200 (a served shared-prefix
# load's profile: 105 ms of a 219 ms first step), where flash's varlen kernel builds
# nothing; under 4K queries flash's extra time is less than one such build (causal
# attention of a 4K run at 32 heads of 128: ~0.35 ms a layer at cuDNN's rate, twice that
# at flash's, 48 layers)
_CUDNN_MIN_RUN = 4096


@dataclass
class PackedRuns:
    """The query runs of a step (`query_runs`) as varlen flash-attention sequences: run i is
    local query rows cu_q[i]:cu_q[i+1] against keys cu_k[i]:cu_k[i+1] of k_flat[keys] (keys
    None: k_flat itself, when the runs' key ranges tile it in order, as at CP 1). A run of
    n queries at positions p0.. of its sequence sees the sequence's keys [0, p0 + n), so the
    causal mask is bottom-right aligned: exactly flash attention's for unequal lengths."""

    keys: torch.Tensor | None  # int64 [K] rows of k_flat, run after run (on the device)
    cu_q: torch.Tensor  # int32 [runs + 1] (on the device)
    cu_k: torch.Tensor  # int32 [runs + 1]
    max_q: int
    max_k: int

    @staticmethod
    def wanted(runs: list[tuple[int, int, int, int]], after_prefix: bool) -> bool:
        """Whether a CUDA step takes its runs in one varlen launch: always for chunks after
        a cached prefix (`chunk_attention_with_lse`), else past _RUNS_PER_LAUNCH runs or
        with a run shorter than _CUDNN_MIN_RUN."""
        return bool(runs) and (after_prefix or len(runs) > _RUNS_PER_LAUNCH
                               or min(b - a for a, b, _, _ in runs) < _CUDNN_MIN_RUN)

    @classmethod
    def build(cls, runs: list[tuple[int, int, int, int]], cu_seqlens: list[int],
              device: torch.device) -> PackedRuns:
        spans = [(cu_seqlens[s], cu_seqlens[s] + p0 + row1 - row0)
                 for row0, row1, s, p0 in runs]
        cu_q = [0] + [row1 for _, row1, _, _ in runs]
        cu_k = [0]
        for a, b in spans:
            cu_k.append(cu_k[-1] + b - a)
        tiled = all(a == k0 for (a, _), k0 in zip(spans, cu_k)) and cu_k[-1] == cu_seqlens[-1]
        keys = None if tiled else torch.cat([torch.arange(a, b) for a, b in spans])
        meta = torch.tensor([cu_q, cu_k], dtype=torch.int32).to(device)
        return cls(None if keys is None else keys.to(device), meta[0], meta[1],
                   max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0),
                   max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0))


@dataclass
class PackedPrefix:
    """The sequences of an extend step with cached tokens on this rank, packed: rows of the
    CP-gathered queries grouped by sequence (`q_rows`) and this rank's slots of each one's
    cached prefix (`slots`, in order), both on the device; `counts` (host) gives each packed
    sequence's (rows, slots), never 0. Sequences with no rows or no slots here are left out:
    their rows see no cached key on this rank (lse -inf); all may be (the step still takes
    the cached-prefix path on every rank: it has collectives). `in_order`: q_rows is
    0, 1, .. (as when every sequence of a CP-1 step has a prefix): `prefix_partial` then
    reads and writes the queries in place, no gather or scatter per layer."""

    q_rows: torch.Tensor  # int64 [R]
    slots: torch.Tensor  # int64 [N]
    counts: list[tuple[int, int]]
    cu_q: torch.Tensor  # int32 [n + 1]
    cu_k: torch.Tensor  # int32 [n + 1]
    max_q: int
    max_k: int
    in_order: bool = False

    @classmethod
    def build(cls, rows: list[torch.Tensor], slots: list[torch.Tensor],
              device: torch.device) -> PackedPrefix:
        keep = [(r, s) for r, s in zip(rows, slots) if r.numel() and s.numel()]
        counts = [(int(r.numel()), int(s.numel())) for r, s in keep]
        cu = torch.tensor([(0, 0)] + counts, dtype=torch.int64).cumsum(0)
        cu_q, cu_k = cu.t().contiguous().to(device, torch.int32)
        none = torch.zeros(0, dtype=torch.int64)
        q_rows = torch.cat([r for r, _ in keep] or [none])
        in_order = torch.equal(q_rows, torch.arange(q_rows.numel()))
        return cls(q_rows.to(device), torch.cat([s for _, s in keep] or [none]).to(device),
                   counts, cu_q, cu_k, max((n for n, _ in counts), default=0),
                   max((n for _, n in counts), default=0), in_order)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences on CUDA (16-bit, GQA heads as they are): q [Tq, H, D] rows
    cu_q[i]:cu_q[i+1] against k/v [Tk, Hkv, D] rows cu_k[i]:cu_k[i+1], causal bottom-right
    aligned -> (o [Tq, H, D], lse [Tq, H] fp32). One flash-attention launch."""
    o, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0,
                                                     causal, False, scale=scale)[:2]
    return o, lse.t()  # varlen flash returns lse as [H, Tq]


def query_runs(positions: torch.Tensor, token_to_seq: torch.Tensor
               ) -> list[tuple[int, int, int, int]]:
    """Host-side: maximal runs of consecutive positions of one sequence among the local rows,
    as (first row, end row, sequence, first position). Zigzag gives two runs per sequence."""
    if positions.numel() == 0:
        return []
    pos, seq = positions.cpu(), token_to_seq.cpu()
    breaks = ((pos[1:] != pos[:-1] + 1) | (seq[1:] != seq[:-1])).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), pos.numel()]
    return [(a, b, int(seq[a]), int(pos[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def prefill_attention(q: torch.Tensor, q_pos: torch.Tensor, q_seq: torch.Tensor,
                      k_flat: torch.Tensor, v_flat: torch.Tensor, cu_seqlens: list[int],
                      scale: float, runs: list[tuple[int, int, int, int]] | None = None,
                      packed: PackedRuns | None = None, fp8: bool = False,
                      o_quant_group: int | None = None,
                      q_descale: torch.Tensor | None = None,
                      k_descale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], its rows' positions and sequences [T] (q_pos; q_seq, the batch's
    `token_to_seq`) against k/v_flat [sum L, Hkv, D] in flat order. On CUDA, given `packed`
    (`PackedRuns.wanted`), one varlen launch for all runs; given the query runs, fused kernels
    per run; neither syncs with the host. `fp8` (CUDA, given the runs, where
    `fp8_runs_apply`): each run in FP8 through cuDNN (`fp8_attention`); then with
    `o_quant_group` (the group of the FP8 o_proj that reads o next, `quantize_act`) and
    every run at the start of its sequence, o stays e4m3: its codes and their scales are
    offered to that GEMM (`ops.fp8.offer_quantized`) and the returned tensor is left
    unwritten (`_runs_fp8`). `q_descale`: q came in e4m3 (`ops.norm_rope_fp8`, where the
    caller found `fp8_runs_apply` true for its 16-bit rows) -> o in v's dtype; `k_descale`:
    k_flat likewise (with q_descale only)."""
    fused = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)  # cuDNN/flash dtypes
    if q_descale is not None or fp8_runs_apply(q, runs, fp8):
        assert runs, "FP8 attention takes query runs"
        return _runs_fp8(q, k_flat, v_flat, cu_seqlens, scale, runs,
                         o_quant_group=o_quant_group, q_descale=q_descale,
                         k_descale=k_descale)[0]
    if fused and packed is not None:
        return _varlen_runs(q, k_flat, v_flat, packed, scale)[0]
    if fused and runs is not None and len(runs) <= 4 * (len(cu_seqlens) - 1):
        return _prefill_runs_cuda(q, k_flat, v_flat, cu_seqlens, scale, runs)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_flat.shape[1]
    for s in range(len(cu_seqlens) - 1):
        rows = (q_seq == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        k = k_flat[cu_seqlens[s]:cu_seqlens[s + 1]].transpose(0, 1)  # [Hkv, L, D]
        v = v_flat[cu_seqlens[s]:cu_seqlens[s + 1]].transpose(0, 1)
        for start in range(0, rows.numel(), _QUERY_CHUNK):
            r = rows[start:start + _QUERY_CHUNK]
            pos = q_pos[r]
            n_keys = int(pos.max()) + 1  # keys past the last query position are all masked
            mask = torch.arange(n_keys, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(
                q[r].transpose(0, 1), k[:, :n_keys], v[:, :n_keys], attn_mask=mask,
                scale=scale, enable_gqa=gqa)
            out[r] = o.transpose(0, 1)
    return out


def partial_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] against one shard k/v [N, Hkv, D] -> o [T, H, D] (fp32), lse [T, H] (fp32)."""
    T, H, D = q.shape
    if k.shape[0] == 0:
        return (torch.zeros(T, H, D, dtype=torch.float32, device=q.device),
                torch.full((T, H), float("-inf"), device=q.device))
    group = H // k.shape[1]
    qf = q.float().reshape(T, k.shape[1], group, D)
    scores = torch.einsum("tkgd,nkd->tkgn", qf, k.float()) * scale
    visible = (k_pos[None, :] <= q_pos[:, None])[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, Hkv, G]
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    o = torch.einsum("tkgn,nkd->tkgd", probs, v.float())
    return o.reshape(T, H, D), lse.reshape(T, H)


def _prefill_runs_cuda(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                       cu_seqlens: list[int], scale: float,
                       runs: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """Each run [p0, p0+n) of one sequence attends keys [0, p0+n) causally: the run's own
    keys with a square causal mask, keys before the run without a mask, the two partial
    results merged by log-sum-exp (fp32, one fused pass written straight into out). Square
    causal and unmasked attention are what the fastest kernels (cuDNN, flash) do natively;
    cuDNN's causal mask is top-left aligned, so it cannot take the run in one call (flash's
    is bottom-right but runs at about half cuDNN's speed here)."""
    out = torch.empty_like(q)
    for row0, row1, s, p0 in runs:
        n, base = row1 - row0, cu_seqlens[s]
        qr = _heads_first(q[row0:row1])
        kd = _heads_first(k_flat[base + p0:base + p0 + n])
        vd = _heads_first(v_flat[base + p0:base + p0 + n])
        if p0 == 0:
            o = F.scaled_dot_product_attention(qr, kd, vd, is_causal=True, scale=scale,
                                               enable_gqa=kd.shape[1] != qr.shape[1])
            out[row0:row1] = o[0].transpose(0, 1)
            continue
        o1, l1 = attention_with_lse(qr, kd, vd, True, scale)
        o2, l2 = attention_with_lse(qr, _heads_first(k_flat[base:base + p0]),
                                    _heads_first(v_flat[base:base + p0]), False, scale)
        ops.merge_two_attention(o1[0].transpose(0, 1), l1[0].transpose(0, 1),
                                o2[0].transpose(0, 1), l2[0].transpose(0, 1), out[row0:row1])
    return out


def _runs_fp8(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
              cu_seqlens: list[int], scale: float, runs: list[tuple[int, int, int, int]],
              with_lse: bool = False, o_quant_group: int | None = None,
              q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_prefill_runs_cuda` in FP8 (`fp8_attention`) -> (o in q's dtype, lse [T, H] fp32
    when `with_lse`): a run at the start of its sequence (or chunk) in one square causal
    call; a later one as its own keys causally and the keys before it in full, merged by
    log-sum-exp (the FP8 kernel's causal mask is top-left aligned on Hopper, as cuDNN's is
    in torch). Every row lies in a run (`query_runs`). `o_quant_group`: see
    `prefill_attention` (`_runs_fp8_offered`); `q_descale`, `k_descale`: q, k_flat in e4m3
    (`prefill_attention`)."""
    from cpmoe.cp.fp8_attention import fp8_attention, o_dtype

    if (o_quant_group and not with_lse and all(p0 == 0 for _, _, _, p0 in runs)
            and (q.shape[1] * q.shape[2]) % o_quant_group == 0 and launch.use_triton(q)):
        return _runs_fp8_offered(q, k_flat, v_flat, cu_seqlens, scale, runs,
                                 o_quant_group, q_descale, k_descale), None
    out = torch.empty(q.shape, dtype=o_dtype(q, v_flat), device=q.device)
    lse = (torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if with_lse
           else None)
    for row0, row1, s, p0 in runs:
        n, base = row1 - row0, cu_seqlens[s]
        own = slice(base + p0, base + p0 + n)
        if p0 == 0:
            _, l1 = fp8_attention(q[row0:row1], k_flat[own], v_flat[own], scale, True,
                                  lse=with_lse, out=out[row0:row1], q_descale=q_descale,
                                  k_descale=k_descale)
            if lse is not None:
                lse[row0:row1] = l1
            continue
        o1, l1 = fp8_attention(q[row0:row1], k_flat[own], v_flat[own], scale, True, lse=True,
                               q_descale=q_descale, k_descale=k_descale)
        o2, l2 = fp8_attention(q[row0:row1], k_flat[base:base + p0], v_flat[base:base + p0],
                               scale, False, lse=True, q_descale=q_descale,
                               k_descale=k_descale)
        ops.merge_two_attention(o1, l1, o2, l2, out[row0:row1])
        if lse is not None:
            lse[row0:row1] = torch.logaddexp(l1, l2)
    return out, lse


def _runs_fp8_offered(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                      cu_seqlens: list[int], scale: float,
                      runs: list[tuple[int, int, int, int]], group: int,
                      q_descale: torch.Tensor | None = None,
                      k_descale: torch.Tensor | None = None) -> torch.Tensor:
    """Every run at the start of its sequence, each one square causal FP8 call whose O stays
    e4m3 (`fp8_attention_e4m3`) -> o [T, H, D] in q's dtype, UNWRITTEN: its rows [T, H * D]
    are offered to the FP8 GEMM that reads them next (`offer_quantized`) as the e4m3 codes
    with their run's per-tensor descale in every 1 x group scale (O's one rounding, by
    cuDNN, is all the GEMM sees: no dequantization pass, no `quantize_act` pass, no second
    rounding). One run: cuDNN's buffer is the offer; several: their codes copied into one."""
    from cpmoe.cp.fp8_attention import fp8_attention_e4m3, o_dtype

    T, H, D = q.shape
    out = torch.empty(q.shape, dtype=o_dtype(q, v_flat), device=q.device)
    codes = None
    scales_t = torch.empty(H * D // group, T, dtype=torch.float32, device=q.device)
    for row0, row1, s, _ in runs:
        n, base = row1 - row0, cu_seqlens[s]
        own = slice(base, base + n)
        o8, descale, _ = fp8_attention_e4m3(q[row0:row1], k_flat[own], v_flat[own], scale,
                                            True, q_descale=q_descale, k_descale=k_descale)
        if n == T:
            codes = o8.view(T, H * D)
        else:
            if codes is None:
                codes = torch.empty(T, H * D, dtype=o8.dtype, device=q.device)
            codes[row0:row1].view(torch.uint8).copy_(o8.view(n, H * D).view(torch.uint8))
        scales_t[:, row0:row1].copy_(descale.view(1, 1).expand(H * D // group, n))
    offer_quantized(out.view(T, H * D), codes, scales_t.t(), group)
    return out


def fp8_runs_apply(q: torch.Tensor, runs: list[tuple[int, int, int, int]] | None,
                   fp8: bool) -> bool:
    """Whether a step's attention (a prefill's runs; an extend chunk's own keys,
    `chunk_attention_with_lse`, and its cached prefix, `prefix_partial`) runs in FP8: `fp8`
    (what the runner decided for the step, `fp8_worth`) on CUDA with 16-bit q."""
    return fp8 and _fp8_device(q) and bool(runs)


def fp8_worth(runs: list[tuple[int, int, int, int]], starts: list[int]) -> bool:
    """Whether FP8 attention pays for a step of these query runs (`query_runs`; starts[s]:
    sequence s's cached tokens): at most _RUNS_PER_LAUNCH runs, each attending at least
    FP8_MIN_PAIRS query-key pairs (`run_pairs`). FP8 takes a few cuDNN calls per run and
    per prefixed sequence, each quantizing its inputs, where 16-bit attention takes one
    varlen launch for all, so short runs (a served batch of 1K prompts, a shared-prefix
    load's questions, the few-token extends of a mixed step) stay 16-bit and the long runs
    of long prompts, or any run after a long cached prefix, go FP8."""
    return (bool(runs) and len(runs) <= _RUNS_PER_LAUNCH
            and min(run_pairs(run, starts[run[2]]) for run in runs) >= FP8_MIN_PAIRS)


def run_pairs(run: tuple[int, int, int, int], start: int = 0) -> int:
    """The query-key pairs a run of n rows from position p0 of its chunk attends: its causal
    square, the chunk's keys before it and its sequence's `start` cached tokens (whichever
    CP rank holds them)."""
    row0, row1, _, p0 = run
    n = row1 - row0
    return n * (start + p0) + n * (n + 1) // 2


# An 8K chunk's causal square. On the H200 at b5d587a a served step of 8 prompts of 1,024
# tokens took 550 ms with one cuDNN FP8 call per run and 130 ms with 16-bit attention (one
# varlen launch for all; bench/results/fp8-serving-b5d587a.log): each of its 384 FP8 calls
# (8 runs x 48 layers) added about 1.1 ms, where a 1K run's attention takes ~14 us, so the
# calls' own work (q, k and v quantized, the descales, the graph's launch) is what cost. An
# 8K square (0.55 TFLOP at 32 heads of 128) takes ~0.9 ms of 16-bit attention, which FP8
# cuts by a third; 16K and 128K prompts and the 8K chunks of a long served prompt stay FP8
# (1.13x / 1.53x prefill, 2.10x the 128K TTFT at b5d587a), and so does a shorter run after
# a long cached prefix (a CP rank's share of a chunk), whose prefix makes up the pairs
FP8_MIN_PAIRS = 8192 * 8193 // 2


def _fp8_device(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _varlen_runs(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                 packed: PackedRuns, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (k_flat, v_flat) if packed.keys is None else (k_flat[packed.keys],
                                                         v_flat[packed.keys])
    return varlen_attention(q, k, v, packed.cu_q, packed.cu_k, packed.max_q, packed.max_k,
                            True, scale)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)[None]  # [n, heads, D] -> [1, heads, n, D]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, H, n, D] x [1, Hkv, m, D] -> (o [1, H, n, D], lse [1, H, n] fp32) on CUDA, through
    the cuDNN kernel when it takes the inputs (GQA heads as they are, else repeated), else
    flash attention (repeated heads)."""
    if k.shape[1] != q.shape[1] and _CUDNN_GQA.get(q.device, True):
        try:
            return _cudnn_with_lse(q, k, v, causal, scale)
        except RuntimeError:  # this cuDNN wants equal head counts
            _CUDNN_GQA[q.device] = False
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    try:
        return _cudnn_with_lse(q, k, v, causal, scale)
    except RuntimeError:  # this cuDNN cannot take the inputs
        pass
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)[:2]
    return o, lse.reshape(q.shape[:3]).float()


_CUDNN_GQA: dict[torch.device, bool] = {}  # whether cuDNN took unequal head counts here


def _cudnn_with_lse(q, k, v, causal: bool, scale: float):
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return o, lse.reshape(q.shape[:3]).float()



def merge_with_lse(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.merge_partials` that also returns the merged lse: o [P, T, H, D], lse [P, T, H]
    -> (o [T, H, D] fp32, lse [T, H] fp32)."""
    return ops.merge_partials(o, lse), torch.logsumexp(lse, dim=0)


def chunk_attention_with_lse(q: torch.Tensor, q_pos: torch.Tensor, q_seq: torch.Tensor,
                             k_flat: torch.Tensor, v_flat: torch.Tensor, cu_seqlens: list[int],
                             scale: float, packed: PackedRuns | None,
                             runs: list[tuple[int, int, int, int]] | None = None,
                             fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """As `prefill_attention` (positions relative to the chunk's first token), returning
    (o [T, H, D], lse [T, H] fp32); in FP8 where `fp8_runs_apply` (per run, o in q's dtype);
    on CUDA given `packed`, one varlen launch (o in q's dtype), else per sequence (o fp32)."""
    if fp8_runs_apply(q, runs, fp8):
        return _runs_fp8(q, k_flat, v_flat, cu_seqlens, scale, runs, with_lse=True)
    T, H, D = q.shape
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and packed is not None:
        return _varlen_runs(q, k_flat, v_flat, packed, scale)
    o = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), device=q.device)
    for s in range(len(cu_seqlens) - 1):
        rows = (q_seq == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        k, v = k_flat[cu_seqlens[s]:cu_seqlens[s + 1]], v_flat[cu_seqlens[s]:cu_seqlens[s + 1]]
        k_pos = torch.arange(k.shape[0], device=q.device)
        o[rows], lse[rows] = partial_attention(q[rows], q_pos[rows], k, v, k_pos, scale)
    return o, lse


def prefix_partial(q: torch.Tensor, prefix: PackedPrefix, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, scale: float, kv_scale: torch.Tensor | None = None,
                   fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, H, D]: the packed sequences' rows (`prefix.q_rows`) against this rank's cached
    slots of their sequence (into the pools viewed as [slots, Hkv, D]; FP8 pools widened
    times kv_scale's k_scale and v_scale, `kv_cache.widen_kv`) -> o [R, H, D],
    lse [R, H] fp32 (-inf for rows of no packed sequence). On CUDA (16-bit) one gather and
    one varlen launch for every sequence, o in q's dtype (its readers widen it as they load
    it: no fp32 copy per layer); else sequence by sequence, o fp32. `fp8` (the step's
    `fp8_runs_apply`, e4m3 pools): sequence by sequence in FP8, the pools' codes read as
    they are with k_scale / v_scale as their descales (no widening), o in q's dtype."""
    if fp8 and prefix.counts:
        return _prefix_fp8(q, prefix, k_pool, v_pool, scale, kv_scale)
    R, H, D = q.shape
    fused = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    if prefix.counts:
        whole = prefix.in_order and prefix.q_rows.numel() == R  # every row, in order
        k_all = k_pool.view(-1, *k_pool.shape[-2:])
        v_all = v_pool.view(-1, *v_pool.shape[-2:])
        qs = q if whole else q[prefix.q_rows]
        ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        k = widen_kv(pool_rows(k_all, prefix.slots), ks, q.dtype)
        v = widen_kv(pool_rows(v_all, prefix.slots), vs, q.dtype)
        if fused:
            om, lm = varlen_attention(qs, k, v, prefix.cu_q, prefix.cu_k, prefix.max_q,
                                      prefix.max_k, False, scale)
            if whole:  # nothing to scatter
                return om, lm
    o = torch.zeros(R, H, D, dtype=q.dtype if fused else torch.float32, device=q.device)
    lse = torch.full((R, H), float("-inf"), device=q.device)
    if not prefix.counts:
        return o, lse
    if fused:
        o[prefix.q_rows], lse[prefix.q_rows] = om, lm
        return o, lse
    zero = torch.zeros(1, dtype=torch.int64, device=q.device)
    row = key = 0
    for rows, slots in prefix.counts:
        om, lm = partial_attention(qs[row:row + rows], zero.expand(rows), k[key:key + slots],
                                   v[key:key + slots], zero.expand(slots), scale)
        o[prefix.q_rows[row:row + rows]], lse[prefix.q_rows[row:row + rows]] = om, lm
        row, key = row + rows, key + slots
    return o, lse


def _prefix_fp8(q: torch.Tensor, prefix: PackedPrefix, k_pool: torch.Tensor,
                v_pool: torch.Tensor, scale: float, kv_scale: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_partial` in FP8: each packed sequence's rows against its cached slots, no
    mask, through `fp8_attention` (e4m3 codes as stored, their scales as descales)."""
    from cpmoe.cp.fp8_attention import fp8_attention

    R, H, D = q.shape
    o = torch.zeros(R, H, D, dtype=q.dtype, device=q.device)
    lse = torch.full((R, H), float("-inf"), device=q.device)
    k_all = k_pool.view(-1, *k_pool.shape[-2:])
    v_all = v_pool.view(-1, *v_pool.shape[-2:])
    unit = torch.ones(2, dtype=torch.float32, device=q.device) if kv_scale is None else None
    k_descale, v_descale = (unit[0:1], unit[1:2]) if unit is not None else (kv_scale[0:1],
                                                                            kv_scale[1:2])
    row = key = 0
    for rows, slots in prefix.counts:
        r = prefix.q_rows[row:row + rows]
        sl = prefix.slots[key:key + slots]
        o[r], lse[r] = fp8_attention(q[r], pool_rows(k_all, sl), pool_rows(v_all, sl), scale,
                                     False, lse=True, k_descale=k_descale,
                                     v_descale=v_descale)
        row, key = row + rows, key + slots
    return o, lse
