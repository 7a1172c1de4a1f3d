"""DeepSeek-V4 attention of one rank: low-rank queries, one shared KV head (read as both key
and value), partial interleaved RoPE, a per-head attention sink, a sliding window on every
layer, compressed KV (CSA: rate 4 chosen by the lightning indexer's top-k; HCA: rate 128,
all causal entries), and the grouped low-rank output projection. HF parameter names.

CP prefill (exact for any split strategy; `deepseek_v4/prefill.py`). Queries stay CP-local.
The K side of a layer (sliding-window KV rows, compressor and indexer projections of every
token) is what crosses chunk boundaries, so each rank projects its own rows and ONE
all-gather over ATTN_CP (`communicator.gather_output`, flat order) replicates those
per-token rows on every rank; every rank then pools the compressed KV and indexer keys of
every sequence of the batch in one gather (replicated compute) and its local queries attend
by their global positions, all sequences at once.

Decode (`deepseek_v4/decode.py`), every row at once over the static cache tensors
(`deepseek_v4/state.py`). Each rank holds, per sequence, the last W-1 KV rows and the
projected rows of the still-open window(s) (replicated, bounded) and its share of the
compressed entries (entry c on CP rank c % attn_cp). A step writes the new token's rows,
pools the window the token completes (its owner keeps the entry), and merges every rank's
partial attention by LSE.

Attention never shards heads (attn_cp == tp, see `check_v4_layout`), so nothing here sums
partial outputs over heads.

Legend: T = query rows, N = K-side rows, H = hidden, D = head dim, R = rope dim,
Hq = query heads, W = sliding window, m = compress rate, C = compressed entries,
K = indexer top-k, F = projected row width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe import communicator
from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.linear import Linear, param
from cpmoe.models.layers import (RMSNorm, RotaryEmbedding, apply_interleaved_rope,
                                 default_inv_freq, unweighted_rms_norm)
from cpmoe.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config, RopeSpec
from cpmoe.models.deepseek_v4.indexer import (ReferenceTopK, indexer_topk, keys_to_ids,
                                              order_keys)
from cpmoe.models.deepseek_v4.rope import head_norm_rope_
from cpmoe.models.deepseek_v4.sparse import kernel_applies
from cpmoe.parallel.groups import ProcessGroups

# ---- RoPE ------------------------------------------------------------------------------------

def rope_inv_freq(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], cos/sin scale) for plain RoPE or YaRN."""
    if spec.rope_type == "default":
        return default_inv_freq(spec.theta, dim), 1.0
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    # transformers always truncates here for V4 (it reads `truncate` from the outer dict).
    low = max(math.floor(correction_dim(spec.beta_fast)), 0)
    high = min(math.ceil(correction_dim(spec.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency
    inv = (1.0 / (spec.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if spec.attention_factor is not None:
        return inv, spec.attention_factor
    if spec.mscale and spec.mscale_all_dim:
        return inv, mscale(spec.factor, spec.mscale) / mscale(spec.factor, spec.mscale_all_dim)
    return inv, mscale(spec.factor)


@dataclass
class Rope:
    """One table and its cos/sin at this forward's local query positions."""

    table: RotaryEmbedding
    cos: torch.Tensor
    sin: torch.Tensor


# ---- compressed KV ---------------------------------------------------------------------------

class DeepseekV4Compressor(nn.Module):
    """Pools every m source tokens into one KV entry. Entry w is the softmax(gate +
    position_bias)-weighted sum of its window's projected rows. With `overlap` (CSA) each row
    carries two series of width d, and entry w mixes window w-1's first series with window
    w's second (width 2m, stride m; window 0 has no predecessor). Entries are RMS-normed and
    rotated at position w*m. Entry w may be read by queries at positions >= (w+1)*m - 1."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.width = (2 if overlap else 1) * dim
        self.kv_proj = Linear(hidden, self.width, bias=False, dtype=dtype)
        self.gate_proj = Linear(hidden, self.width, bias=False, dtype=dtype)
        self.position_bias = param(rate, self.width, dtype=torch.float32)
        self.kv_norm = RMSNorm(dim, eps, torch.float32)
        self.indexer: DeepseekV4Indexer | None = None  # set on CSA compressors

    def project(self, x_TH: torch.Tensor) -> torch.Tensor:
        """-> [T, 2F]: kv then gate projections, the per-token input of `extend`."""
        return torch.cat([self.kv_proj(x_TH), self.gate_proj(x_TH)], dim=-1)

    def pool_flat(self, rows_N2F: torch.Tensor, start_E: torch.Tensor, window_E: torch.Tensor,
                  rope: RotaryEmbedding) -> torch.Tensor:
        """Entries of many sequences at once -> [E, d]: entry e pools window window_E[e] of
        its sequence, whose rows start at flat row start_E[e] of rows_N2F (with overlap
        also the m rows before it, none for window 0)."""
        idx = start_E[:, None] + torch.arange(self.rate, device=start_E.device)  # [E, m]
        prev = rows_N2F[(idx - self.rate).clamp(min=0)] if self.overlap else None
        return self.pool_windows(rows_N2F[idx], prev, window_E, rope)

    def pool_windows(self, win_Em2F: torch.Tensor, prev_Em2F: torch.Tensor | None,
                     window_E: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """Entry e from the projected rows of its window window_E[e] [E, m, 2F] (with
        overlap also those of the window before, ignored for window 0) -> [E, d]."""
        m, d, Fw = self.rate, self.dim, self.width
        kv, gate = win_Em2F[..., :Fw], win_Em2F[..., Fw:] + self.position_bias
        if self.overlap:
            assert prev_Em2F is not None
            first = (window_E == 0)[:, None, None]
            prev_kv = prev_Em2F[..., :d].masked_fill(first, 0.0)
            prev_gate = (prev_Em2F[..., Fw:Fw + d] + self.position_bias[:, :d]).masked_fill(
                first, float("-inf"))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.kv_norm((kv * weights).sum(dim=1))
        return _rotate(pooled, *rope(window_E * m, pooled.dtype))


class DeepseekV4IndexerScorer(nn.Module):
    """score[t, c] = sum_h w[t, h] * relu(q[t, h] . k[c]) / sqrt(dI), w = weights_proj(x)."""

    def __init__(self, hidden: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.softmax_scale, self.weights_scaling = dim ** -0.5, heads ** -0.5
        self.weights_proj = Linear(hidden, heads, bias=False, dtype=dtype)

    def forward(self, q: torch.Tensor, keys: torch.Tensor, x_TH: torch.Tensor,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, h, dI] against keys [C, dI] shared by every row (keys [T, C, dI]: per row);
        with visible [T, C], -inf where it is False. For fp32 inputs the math is fp64,
        rounded to fp32 at the end: a score then does not depend on how many rows and
        entries share the kernels (batch composition, CP shard; fp32 reductions order by
        shape), so near-tied top-k picks do not flip between layouts; fp32 for 16-bit
        inputs (prefill on CUDA in 16 bits scores with `deepseek_v4_indexer`'s kernel
        instead, `select_visible`)."""
        acc = torch.float64 if q.dtype == torch.float32 else torch.float32
        if keys.dim() == 3:
            dots = torch.einsum("thd,tcd->thc", q.to(acc), keys.to(acc))
        else:
            dots = torch.matmul(q.to(acc), keys.to(acc).T)
        scores = F.relu(dots) * self.softmax_scale
        weights = self.weights_proj(x_TH).to(acc) * self.weights_scaling
        scores = (scores * weights[..., None]).sum(dim=1).float()
        return scores if visible is None else scores.masked_fill(~visible, float("-inf"))

    def head_weights(self, x_TH: torch.Tensor) -> torch.Tensor:
        """w [T, h] float32, scaled by h^-0.5: each head's weight in a row's score."""
        return self.weights_proj(x_TH).float() * self.weights_scaling


class DeepseekV4Indexer(DeepseekV4Compressor):
    """Lightning indexer of a CSA layer: its own overlapping compressor at index_head_dim
    gives the keys; queries come from the low-rank query residual."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.compress_rate_csa, True,
                         cfg.rms_norm_eps, dtype)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False, dtype=dtype)
        self.scorer = DeepseekV4IndexerScorer(cfg.hidden_size, self.heads, self.dim, dtype)
        self.reference_topk = ReferenceTopK()  # float32 picks, ties as the reference's

    def row_scores(self, q_res: torch.Tensor, x_TH: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, keys_TCd: torch.Tensor) -> torch.Tensor:
        """Scores [T, C] of each row's own keys [T, C, dI] (decode over a cache shard)."""
        q = self.q_b_proj(q_res).view(q_res.shape[0], self.heads, self.dim)
        return self.scorer(_rotate(q, cos, sin), keys_TCd, x_TH)

    def select_visible(self, q_res: torch.Tensor, x_TH: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, keys_Ed: torch.Tensor, lo_T: torch.Tensor,
                       hi_T: torch.Tensor, total_T: torch.Tensor,
                       rows_T: torch.Tensor) -> torch.Tensor:
        """-> [T, min(topk, E)] indices into keys_Ed, best first; -1 where the pick is not
        visible to the row: row t sees entries [lo[t], hi[t]) (its own sequence's, whose
        window has closed) of its sequence's total[t] entries in this forward (from lo[t];
        keys_Ed need only reach the last visible one); rows_T: the rows' indices among the
        forward's local rows. In float32 the picks are the reference's, ties included
        (`indexer.topk_as_reference`: its row of total[t] entries). On CUDA in 16 bits one kernel scores and masks, and a top-k over
        keys that order as a stable sort does picks (equal scores to the lower entry,
        `indexer.indexer_topk`)."""
        q = _rotate(self.q_b_proj(q_res).view(q_res.shape[0], self.heads, self.dim), cos, sin)
        k = min(self.topk, keys_Ed.shape[0])
        if keys_Ed.dtype == q.dtype and kernel_applies(q.device, q.dtype):
            return indexer_topk(q, keys_Ed, self.scorer.head_weights(x_TH),
                                self.scorer.softmax_scale, (lo_T, hi_T), k)
        c = torch.arange(keys_Ed.shape[0], device=keys_Ed.device)
        visible = (c[None, :] >= lo_T[:, None]) & (c[None, :] < hi_T[:, None])
        scores = self.scorer(q, keys_Ed, x_TH, visible)
        if q.dtype == torch.float32:
            return self.reference_topk(scores, lo_T, total_T, k, rows_T)
        # equal scores to the lower entry, by order keys and a top-k (no sort); entries
        # not visible scored -inf: -1
        return keys_to_ids(order_keys(scores, c.expand_as(scores)).topk(k, dim=-1).values)


# ---- attention -------------------------------------------------------------------------------

def _rope_in_place(x_ThD: torch.Tensor) -> bool:
    """Whether the query norm + RoPE and the rotations of tensors the layer has just made run
    as in-place kernel passes (`deepseek_v4/rope.py`: CUDA, 16 bits) instead of the torch
    expressions."""
    return kernel_applies(x_ThD.device, x_ThD.dtype) and x_ThD.stride(-1) == 1


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_interleaved_rope(x, cos, sin) of x [T, D] or [T, h, D] that this layer has just
    made (nothing else holds it): on CUDA in 16 bits rotated in place, only the rotated
    channels read and written, not a float32 pair copy, a stack and a cat of whole rows."""
    if not _rope_in_place(x):
        return apply_interleaved_rope(x, cos, sin)
    head_norm_rope_(x if x.dim() == 3 else x[:, None], cos, sin, 0.0, norm=False)
    return x


@dataclass
class Queries:
    """Query-side tensors of every local row of this forward."""

    q: torch.Tensor  # [T, Hq, D], normed and rotated
    q_res: torch.Tensor  # [T, q_lora_rank], the indexer's query input
    x: torch.Tensor  # [T, H], the attention input (indexer head weights)
    pos: torch.Tensor  # [T] absolute positions
    cos: torch.Tensor  # [T, R/2] of the layer's RoPE table
    sin: torch.Tensor


class DeepseekV4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, groups: ProcessGroups,
                 dtype: torch.dtype) -> None:
        super().__init__()
        H, D, Hq, g = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
        self.layer, self.groups, self.kind = layer, groups, cfg.layer_types[layer]
        self.rope_name = "main" if self.kind == SLIDING else "compress"
        self.num_heads, self.head_dim, self.window = Hq, D, cfg.sliding_window
        self.scale, self.eps, self.o_groups = D ** -0.5, cfg.rms_norm_eps, g
        self.q_a_proj = Linear(H, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, torch.float32)
        self.q_b_proj = Linear(cfg.q_lora_rank, Hq * D, bias=False, dtype=dtype)
        self.kv_proj = Linear(H, D, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps, torch.float32)
        # Grouped output projection: block-diagonal [g * o_lora, Hq*D/g], one block per group.
        self.o_a_proj = Linear(Hq * D // g, g * cfg.o_lora_rank, bias=False, dtype=dtype)
        self.o_b_proj = Linear(g * cfg.o_lora_rank, H, bias=False, dtype=dtype)
        self.sinks = param(Hq, dtype=torch.float32)
        self.compressor: DeepseekV4Compressor | None = None
        if self.kind != SLIDING:
            self.compressor = DeepseekV4Compressor(H, D, cfg.compress_rate(layer),
                                                   self.kind == CSA, cfg.rms_norm_eps, dtype)
            self.compressor.indexer = DeepseekV4Indexer(cfg, dtype) if self.kind == CSA else None

    # -- K side ---------------------------------------------------------------------------
    def _k_side(self, x_TH: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Per-token rows [T, D + 2Fc + 2Fi]: rotated KV, compressor and indexer projections."""
        parts = [_rotate(self.kv_norm(self.kv_proj(x_TH)), rope.cos, rope.sin)]
        if self.compressor is not None:
            parts.append(self.compressor.project(x_TH))
            if self.compressor.indexer is not None:
                parts.append(self.compressor.indexer.project(x_TH))
        return torch.cat(parts, dim=-1)

    def prepare(self, x_TH: torch.Tensor, rope: Rope,
                batch: ForwardBatch) -> tuple[Queries, torch.Tensor]:
        """This rank's rows [T, H] -> their queries and the K-side rows of every token of the
        forward (the layer's one CP collective, flat order). The decoder layer hands both to
        the prefill or the decode path (`prefill.py`, `decode.py`), which import this module's
        types; this module imports neither."""
        T, Hq, D = x_TH.shape[0], self.num_heads, self.head_dim
        q_res = self.q_a_norm(self.q_a_proj(x_TH))
        q = self.q_b_proj(q_res).view(T, Hq, D)
        if _rope_in_place(q):
            q = head_norm_rope_(q, rope.cos, rope.sin, self.eps)
        else:
            q = apply_interleaved_rope(unweighted_rms_norm(q, self.eps), rope.cos, rope.sin)
        k_side = communicator.gather_output(self._k_side(x_TH, rope), batch, self.groups)
        return Queries(q, q_res, x_TH, batch.positions, rope.cos, rope.sin), k_side

    def finish(self, out_ThD: torch.Tensor, rope: Rope) -> torch.Tensor:
        """The attention output [T, Hq, D] -> [T, H], complete (no partial sums)."""
        # K = V carries RoPE on its trailing channels: rotate the output back at the query.
        if _rope_in_place(out_ThD):
            o = head_norm_rope_(out_ThD, rope.cos, rope.sin, self.eps, norm=False, sin_sign=-1.0)
        else:
            o = apply_interleaved_rope(out_ThD, rope.cos, -rope.sin)
        T, Hq, D = out_ThD.shape  # T may be 0: a CP rank with no row of this step
        return self.o_b_proj(self._grouped_o_a(o.view(T, self.o_groups, Hq * D // self.o_groups)))

    def _grouped_o_a(self, o_TGI: torch.Tensor) -> torch.Tensor:
        """Group g's rows o[:, g] times its block of o_a_proj -> [T, g * o_lora]. One bmm
        over strided views, written straight into the result's layout: einsum made the
        [g, T, i] operand contiguous first (a copy of the whole attention output, 1 GiB
        per layer at 16K tokens in bf16)."""
        T, g, i = o_TGI.shape
        w = self.o_a_proj.weight.view(g, -1, i)
        out = torch.empty(T, g, w.shape[1], dtype=o_TGI.dtype, device=o_TGI.device)
        torch.bmm(o_TGI.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
        return out.flatten(1)
