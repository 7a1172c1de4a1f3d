"""DeepSeek-V4 decode attention over caches sharded across the CP ranks.

Storage (per sequence and layer, `SeqState`): compressed KV entry c and its indexer key live
on CP rank c % cp_size only (round-robin by entry, so shards differ by at most one entry);
the sliding window (W-1 rows) and the compressors' still-open window rows (at most 2m rows)
are bounded and stay replicated, so every rank can pool a window the moment it closes and
the owner keeps the entry.

A decode step (the rows are the same on every rank): each rank attends its share of the
keys of every row and the shares are merged by log-sum-exp, exactly as one rank would:
- window keys: every rank holds them all but attends only positions p with p % cp == rank;
- HCA: every entry it holds (all closed);
- CSA: the lightning indexer scores the entries this rank holds, each rank offers its best
  `index_topk` (score, entry id) pairs, ONE all-gather over ATTN_CP gives every rank the
  same candidates, and the global top-k is taken with ties broken by the lower entry id
  (one rank breaks ties the same way); each rank then attends its own picks;
- the attention sink's logit enters the softmax once, on CP rank 0;
- partial outputs and LSEs meet in ONE all-gather (`communicator.merge_decode_attention`).
The global top-k of the union of per-rank top-ks is the top-k of all entries.

Legend: B = decode rows, W = sliding window, C = this rank's entries of a row (padded),
K = index_topk, D = head dim, dI = indexer head dim, Hq = query heads, nI = indexer heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from cpmoe import communicator as cm
from cpmoe.engine.forward import ForwardBatch
from cpmoe.parallel import comm
from cpmoe.parallel.groups import Group

if TYPE_CHECKING:
    from cpmoe.models.deepseek_v4_attention import DeepseekV4Attention, Queries, RopeTable


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


def _pad_rows(parts: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row tensors [n_b, d] -> ([B, max(max n_b, 1), d] zero-padded, valid [B, .])."""
    lens = torch.tensor([p.shape[0] for p in parts])
    out = pad_sequence(parts, batch_first=True)
    if out.shape[1] == 0:
        out = out.new_zeros((len(parts), 1, width))
    valid = torch.arange(out.shape[1])[None, :] < lens[:, None]
    return out, valid.to(out.device)


def _global_topk(scores_BC: torch.Tensor, valid_BC: torch.Tensor, k: int,
                 cp: Group) -> torch.Tensor:
    """This rank's indexer scores of its entries (local index j = entry j*cp + rank) -> the
    ids of the k best entries over all ranks [B, k] (-1: fewer than k entries), ordered by
    score then entry id, the same on every rank."""
    B = scores_BC.shape[0]
    scores = scores_BC.masked_fill(~valid_BC, float("-inf"))
    if scores.shape[1] < k:
        scores = F.pad(scores, (0, k - scores.shape[1]), value=float("-inf"))
    best = scores.sort(dim=-1, descending=True, stable=True)
    top_s, top_j = best.values[:, :k], best.indices[:, :k]
    ids = top_j * cp.size + cp.rank
    if cp.size > 1:  # one all-gather of (score, id) candidates, ids exact in fp32
        packed = torch.cat([top_s, ids.to(top_s.dtype)], dim=1)
        parts = comm.all_gather(packed, cp).view(cp.size, B, 2 * k)
        top_s = parts[..., :k].permute(1, 0, 2).reshape(B, -1)
        ids = parts[..., k:].permute(1, 0, 2).reshape(B, -1).to(torch.int64)
        by_id = ids.argsort(dim=-1, stable=True)
        top_s, ids = top_s.gather(1, by_id), ids.gather(1, by_id)
        by_score = top_s.argsort(dim=-1, descending=True, stable=True)[:, :k]
        top_s, ids = top_s.gather(1, by_score), ids.gather(1, by_score)
    return torch.where(top_s > float("-inf"), ids, -1)


def decode_attention(attn: DeepseekV4Attention, qs: Queries, k_side: torch.Tensor,
                     batch: ForwardBatch, rope: RopeTable) -> torch.Tensor:
    """One decode step of layer `attn` for every row -> attention output [B, Hq, D] (before
    the inverse RoPE and the output projection), the same on every CP rank. Extends and
    stores each row's sharded state in batch.kv."""
    cp = attn.groups.attn_cp
    kv, W, D, c = batch.kv, attn.window, attn.head_dim, attn.compressor
    assert kv is not None and batch.seq_keys is not None, "V4 decode needs the cache"
    windows, entries, index_keys = [], [], []
    for i, key in enumerate(batch.seq_keys):
        end = kv.seqs[key].length  # host-side: the row's position + 1
        keys, st = attn.extend_state(kv.state(key, attn.layer), k_side[i:i + 1], end, rope,
                                (cp.rank, cp.size))
        kv.put(key, attn.layer, st)
        windows.append(F.pad(keys[-W:], (0, 0, W - min(W, keys.shape[0]), 0)))
        if st.comp is not None:
            entries.append(st.comp.entries)
        if st.index is not None:
            index_keys.append(st.index.entries)
    pos = qs.pos
    kpos = pos[:, None] - (W - 1) + torch.arange(W, device=pos.device)  # [B, W]
    kv_BND = torch.stack(windows)
    valid = (kpos >= 0) & (kpos % cp.size == cp.rank)
    if c is not None:
        ent, ent_valid = _pad_rows(entries, D)
        if c.indexer is not None:
            keys_BCd, key_valid = _pad_rows(index_keys, c.indexer.dim)
            scores = c.indexer.row_scores(qs.q_res, qs.x, qs.cos, qs.sin, keys_BCd)
            picks = _global_topk(scores, key_valid, c.indexer.topk, cp)
            mine = (picks >= 0) & (picks % cp.size == cp.rank)
            local = torch.where(mine, picks // cp.size, 0)
            ent = ent.gather(1, local[..., None].expand(-1, -1, D))
            ent_valid = mine
        kv_BND = torch.cat([kv_BND, ent.to(kv_BND.dtype)], dim=1)
        valid = torch.cat([valid, ent_valid], dim=1)
    o, lse = partial_sink_attention(qs.q, kv_BND, valid,
                                    attn.sinks if cp.rank == 0 else None, attn.scale)
    return cm.merge_decode_attention(o, lse, attn.groups).to(qs.q.dtype)
