"""DeepSeek-V4 decode attention over caches sharded across the CP ranks, every row at once.

Storage (`V4Cache`'s static tensors, deepseek_v4/state.py): compressed KV entry c and its
indexer key live on CP rank c % cp_size only (round-robin by entry, so shards differ by at
most one entry); the sliding window (a ring of W rows) and the compressors' rings of
projected rows (m rows, 2m with overlap) are bounded and replicated, so every rank can pool
a window the moment it closes and the owner keeps the entry.

A decode step is a fixed sequence of tensor ops on the `DecodeStep`'s indices: no host
sync, no data-dependent shape or Python branch, so CUDA graphs capture it
(deepseek_v4/graph.py). Each row writes its KV row and projected rows into the rings; every
row pools the window ending at its token (a row that closes none, or whose entry another
rank owns, writes the result to the trash slot); then each rank attends its share of the
keys of every row and the shares are merged by log-sum-exp, exactly as one rank would:
- window keys: every rank holds them all but attends only positions p with p % cp == rank;
- HCA: every entry it holds (all closed);
- CSA: the lightning indexer scores the entries this rank holds, each rank offers its best
  `index_topk` (score, entry id) pairs, ONE all-gather over ATTN_CP gives every rank the
  same candidates, and the global top-k is taken with ties broken by the lower entry id
  (one rank breaks ties the same way); each rank then attends its own picks. In float32
  the all-gather carries every score instead and each row's top-k is the reference's over
  its entries in entry order (`topk_as_reference`: ties picked as transformers picks them);
- the attention sink's logit enters the softmax once, on CP rank 0;
- partial outputs and LSEs meet in ONE all-gather (`communicator.merge_decode_attention`).
The global top-k of the union of per-rank top-ks is the top-k of all entries.

Legend: B = decode rows, W = sliding window, C = this rank's entries of a row (padded to
whole pages), K = index_topk, D = head dim, dI = indexer head dim, Hq = query heads,
m = compress rate, R = ring rows, F2 = projected row width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpmoe import communicator
from cpmoe.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4Compressor, Queries
from cpmoe.models.deepseek_v4.cache import V4Cache
from cpmoe.models.deepseek_v4.indexer import ReferenceTopK, keys_to_ids, order_keys, top_keys
from cpmoe.models.deepseek_v4.state import ENTRY_PAGE, CompressorPool, DecodeStep
from cpmoe.models.layers import RotaryEmbedding
from cpmoe.parallel import comm
from cpmoe.parallel.groups import Group


def partial_sink_attention(q_BHD: torch.Tensor, kv_BND: torch.Tensor, valid_BN: torch.Tensor,
                           sinks: torch.Tensor | None, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the valid keys of its row (K = V) -> (o [B, Hq, D], lse [B, Hq]);
    with `sinks` the per-head sink logit joins the softmax (its mass dropped). A row with no
    valid key and no sink has lse -inf and o 0 (weight 0 in the merge). Math in fp32, in
    fp64 for fp32 inputs: the CP merge then adds no error above fp32 rounding."""
    acc = torch.float64 if q_BHD.dtype == torch.float32 else torch.float32
    kvf = kv_BND.to(acc)
    s = torch.einsum("bhd,bnd->bhn", q_BHD.to(acc), kvf) * scale
    s = s.masked_fill(~valid_BN[:, None, :], float("-inf"))
    logits = s
    if sinks is not None:
        logits = torch.cat([s, sinks.to(acc).view(1, -1, 1).expand(s.shape[0], -1, 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("bhn,bnd->bhd", p, kvf), lse


def local_candidates(scores_BC: torch.Tensor, valid_BC: torch.Tensor, k: int, rank: int,
                     size: int) -> torch.Tensor:
    """This rank's indexer scores of its entries (local index j = entry j*size + rank) ->
    its k best as int64 order keys [B, k] (`indexer.order_keys`: score, then entry id)."""
    scores = scores_BC.float().masked_fill(~valid_BC, float("-inf"))
    ids = torch.arange(scores.shape[1], device=scores.device) * size + rank
    return top_keys(order_keys(scores, ids.expand_as(scores)), k)


def _global_topk(scores_BC: torch.Tensor, valid_BC: torch.Tensor, k: int,
                 cp: Group) -> torch.Tensor:
    """The ids of the k best entries over all ranks [B, k] (-1: fewer than k entries),
    ordered by score then entry id (equal scores: the lower entry), the same on every rank.
    Without a sort: the keys order by (score, entry id) and are unique, so `torch.topk` of
    each rank's keys, then of the union (ONE all-gather of int64 keys), picks what a stable
    sort of all entries' scores picks (the global top-k is the top-k of the per-rank
    top-ks)."""
    top = local_candidates(scores_BC, valid_BC, k, cp.rank, cp.size)
    if cp.size > 1:
        B = top.shape[0]
        parts = comm.all_gather(top, cp).view(cp.size, B, k)
        top = top_keys(parts.permute(1, 0, 2).reshape(B, cp.size * k), k)
    return keys_to_ids(top)


def _reference_topk(pick: ReferenceTopK, scores_BC: torch.Tensor, valid_BC: torch.Tensor,
                    k: int, total_B: torch.Tensor, cp: Group) -> torch.Tensor:
    """float32: the picks of the reference's row (`pick`, the indexer's `ReferenceTopK`):
    every rank's scores in ONE all-gather, laid out by entry id (local j of rank r is entry
    j*cp + r), and each row's top-k over its total_B entries -> [B, k] entry ids, the same
    on every rank. Host syncs (the widths, the lengths): eager steps only, as float32
    decode runs."""
    B = scores_BC.shape[0]
    scores = scores_BC.masked_fill(~valid_BC, float("-inf"))
    width = -(-int(total_B.max()) // cp.size) if B else 0  # local entries of the longest row
    if scores.shape[1] < width:
        scores = F.pad(scores, (0, width - scores.shape[1]), value=float("-inf"))
    scores = scores[:, :width].contiguous()
    if cp.size > 1:
        parts = comm.all_gather(scores, cp).view(cp.size, B, width)
        scores = parts.permute(1, 2, 0).reshape(B, width * cp.size)
    return pick(scores, torch.zeros_like(total_B), total_B, k,
                torch.arange(B, device=scores.device))


def decode_attention(attn: DeepseekV4Attention, qs: Queries, k_side: torch.Tensor,
                     step: DecodeStep, kv: V4Cache, rope: RotaryEmbedding) -> torch.Tensor:
    """One decode step of layer `attn` for every row -> attention output [B, Hq, D] (before
    the inverse RoPE and the output projection), the same on every CP rank. Writes the
    rows' new state into kv's tensors at `step`'s indices."""
    cp, lc = attn.groups.attn_cp, kv.layers[attn.layer]
    W, D, c = attn.window, attn.head_dim, attn.compressor
    pos, slot = qs.pos, step.seq_slot
    lc.window[slot, pos % W] = k_side[:, :D].to(lc.window.dtype)
    kpos = pos[:, None] - (W - 1) + torch.arange(W, device=pos.device)  # [B, W]
    kv_BND = lc.window[slot[:, None], kpos % W]
    valid = (kpos >= 0) & (kpos % cp.size == cp.rank)
    if c is not None:
        assert lc.comp is not None
        m = c.rate
        _close_windows(c, lc.comp, k_side[:, D:D + 2 * c.width], pos, slot, step.write[m],
                       rope)
        ent_BC = _entry_slots(kv.page_table[m][slot, :step.widths[m]])
        ent_valid = (torch.arange(ent_BC.shape[1], device=pos.device)[None, :]
                     < step.count[m][:, None])
        if c.indexer is not None:
            assert lc.index is not None
            _close_windows(c.indexer, lc.index, k_side[:, D + 2 * c.width:], pos, slot,
                           step.write[m], rope)
            scores = c.indexer.row_scores(qs.q_res, qs.x, qs.cos, qs.sin,
                                          lc.index.entries[ent_BC])
            if qs.q.dtype == torch.float32:  # the reference dtype (eager steps)
                picks = _reference_topk(c.indexer.reference_topk, scores, ent_valid,
                                        c.indexer.topk, (pos + 1) // m, cp)
            else:
                picks = _global_topk(scores, ent_valid, c.indexer.topk, cp)
            mine = (picks >= 0) & (picks % cp.size == cp.rank)
            ent_BC = ent_BC.gather(1, torch.where(mine, picks // cp.size, 0))
            ent_valid = mine
        kv_BND = torch.cat([kv_BND, lc.comp.entries[ent_BC].to(kv_BND.dtype)], dim=1)
        valid = torch.cat([valid, ent_valid], dim=1)
    o, lse = partial_sink_attention(qs.q, kv_BND, valid,
                                    attn.sinks if cp.rank == 0 else None, attn.scale)
    return communicator.merge_decode_attention(o, lse, attn.groups).to(qs.q.dtype)


def _entry_slots(pages_BP: torch.Tensor) -> torch.Tensor:
    """Page ids [B, Pm] -> entry slots [B, Pm * ENTRY_PAGE] (local entry j at column j)."""
    within = torch.arange(ENTRY_PAGE, device=pages_BP.device)
    return (pages_BP[:, :, None] * ENTRY_PAGE + within).flatten(1)


def _close_windows(comp: DeepseekV4Compressor, pool: CompressorPool, rows_BF2: torch.Tensor,
                   pos: torch.Tensor, slot: torch.Tensor, write: torch.Tensor,
                   rope: RotaryEmbedding) -> None:
    """Each row's projected row into its ring; the window ending at the row's token is
    pooled for every row and stored at `write` (the trash slot unless the token closes a
    window whose entry this rank owns). The ring holds the window (and with overlap the one
    before), as the row of position p sits at p % R."""
    m, R = comp.rate, pool.rows.shape[1]
    pool.rows[slot, pos % R] = rows_BF2.to(pool.rows.dtype)
    w = (pos + 1) // m - 1  # the window the token closes, if it closes one
    idx = (w[:, None] * m + torch.arange(m, device=pos.device)) % R  # [B, m]
    win = pool.rows[slot[:, None], idx]
    prev = pool.rows[slot[:, None], (idx - m) % R] if comp.overlap else None
    pooled = comp.pool_windows(win, prev, w.clamp(min=0), rope)
    pool.entries[write] = pooled.to(pool.entries.dtype)
