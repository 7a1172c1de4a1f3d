"""DeepSeek-V4 prefill attention for every sequence of a batch at once.

`PrefillPlan` is built once per forward from what every rank shares (the CP split, host
side): where each sequence's rows lie in the flat K side, where each of its compressed
entries starts, and blocks of local query rows sized by a memory budget. A layer then runs
without per-sequence work:
- the compressor and the indexer pool the entries of every sequence in one gather (entry w
  of a sequence mixes its window w, and with overlap window w-1; the first has none);
- per block of query rows (several sequences, one block for any prompt that fits the
  budget): each row's keys are an index list into [K-side KV rows ; pooled entries] -- the
  W window positions, then its HCA entries (every closed entry of its sequence, in order) or
  its CSA picks (the indexer's top-k over the closed entries of its sequence, scored against
  the block's entry range up to the last entry any of its rows sees, other sequences and
  open windows masked; in float32 each row's top-k is the reference's, over its sequence's
  entries of the forward, `indexer.topk_as_reference`; on CUDA in 16 bits by a Triton kernel without the [rows, heads,
  entries] dot products, and a top-k instead of a sort, `deepseek_v4/indexer.py`) --
  attended with the sink: on CUDA in 16 bits by a Triton kernel that walks the index lists
  without gathering and stops at each row's last visible key (`deepseek_v4/sparse.py`),
  elsewhere gathered once and attended in fp32 by `sink_attention`, the reference.
  Per-block extents come from the plan (host), so nothing syncs.
Exact for any CP split: K-side rows are in flat order on every rank and queries carry their
absolute positions. A sequence that continues a cached prefix (a chunk of a long prompt)
gets the prefix's ring rows ahead of its new K-side rows and its cached entries ahead of
its new ones (`extend.py`), so a chunked prompt gives the whole prompt's logits; its rows'
indexer top-k ranks over the whole prompt's entries (`ForwardBatch.seq_ends`).

Legend: T = local query rows, N = flat K-side rows, E = entries of the batch, W = window,
S = compressed keys per row, B = sequences, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.models.deepseek_v4.attention import DeepseekV4Attention, Queries
from cpmoe.models.deepseek_v4.cache import V4Cache
from cpmoe.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from cpmoe.models.deepseek_v4.extend import (PrefixPlan, augment_rows, entries_with_prefix,
                                             prefix_rows)
from cpmoe.models.deepseek_v4.sparse import kernel_applies, sparse_sink_attention
from cpmoe.models.layers import RotaryEmbedding


# Elements of the largest per-block temporary (the indexer's scores, or on the torch path the
# gathered keys and their scores): ~256 MB in fp32, twice that where fp32 inputs take fp64.
_BLOCK_ELEMS = 1 << 26
# fp32-sized elements per key of a row on the kernel path: the int64 index lists (window,
# picks, their concatenation) and the masks, nothing gathered.
_KERNEL_KEY_ELEMS = 8
# fp32-sized elements per CSA entry of a row on the kernel path, counted from the code
# (tests/gpu/test_v4_indexer_cuda.py measures the peak): the indexer kernel's int64 order
# keys (2) and what `torch.topk` of a few hundred picks allocates beside them (the keys are
# not sorted), rounded up.
_KERNEL_INDEX_ELEMS = 4


def rows_per_block(keys: int, heads: int, head_dim: int, index_heads: int, entries: int,
                   kernel: bool) -> int:
    """Query rows of a block whose per-row temporaries fit `_BLOCK_ELEMS`. Per row: its key
    list (`keys` = W + CSA picks or HCA entries), gathered [keys, D] and scored [Hq, keys] in
    fp32 on the torch path, only indices and masks with the kernel; and the indexer's scores
    against the block's CSA entries (at most `entries`, all of the batch's): [index_heads,
    entries] fp32 dot products on the torch path, only [entries] order keys and the top-k's
    temporaries with the kernel."""
    if kernel:
        per_row = max(keys * _KERNEL_KEY_ELEMS, entries * _KERNEL_INDEX_ELEMS)
    else:
        per_row = max(keys * (heads + head_dim), index_heads * entries)
    return max(1, _BLOCK_ELEMS // max(1, per_row))


@dataclass
class EntryIndex:
    """The compressed entries of every sequence at one rate m, in flat order: per sequence
    the entries closed before the forward (a cached prefix's, `extend.py`), then the ones
    its new tokens close, which the forward pools."""

    counts: list[int]  # entries per sequence (host), prefix ones included
    offsets: list[int]  # first entry of each sequence (host), plus the total
    start_row: torch.Tensor  # [E_new] flat K-side row where a new entry's window starts
    window: torch.Tensor  # [E_new] its window index w within its sequence

    @classmethod
    def build(cls, cu: list[int], rate: int, device: torch.device,
              firsts: list[int] | None = None, starts: list[int] | None = None
              ) -> "EntryIndex":
        """cu: flat K-side row offsets; sequence s's rows hold positions firsts[s] .. (its
        first cached-prefix row, 0 without) and its new tokens start at starts[s]."""
        n = len(cu) - 1
        firsts, starts = firsts or [0] * n, starts or [0] * n
        ends = [f + b - a for f, a, b in zip(firsts, cu[:-1], cu[1:])]
        counts = [e // rate for e in ends]
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        done = torch.tensor([st // rate for st in starts], dtype=torch.int64)
        fresh = torch.tensor(counts, dtype=torch.int64) - done
        fresh_off = torch.cumsum(fresh, 0) - fresh
        seq = torch.repeat_interleave(torch.arange(n), fresh)
        window = torch.arange(int(fresh.sum())) - fresh_off[seq] + done[seq]
        base = torch.tensor(cu[:-1], dtype=torch.int64) - torch.tensor(firsts, dtype=torch.int64)
        start = base[seq] + window * rate
        return cls(counts, offsets, start.to(device), window.to(device))


@dataclass
class PrefillPlan:
    cu: list[int]  # flat K-side row offsets of the sequences (host), prefix rows included
    firsts: list[int]  # position of each sequence's first K-side row (host)
    row_seq: torch.Tensor  # [T] sequence of each local query row
    row_base: torch.Tensor  # [T] flat K-side row of its sequence's position 0 (virtual
    # when the sequence's rows start after position 0)
    row_first: torch.Tensor  # [T] position of its sequence's first K-side row
    blocks: list[tuple[int, int, int, int]]  # (row0, row1, first seq, last seq + 1)
    entries: dict[int, EntryIndex]  # by compress rate
    # by compress rate: per local row, its sequence's first entry (flat), how many of its
    # sequence's entries it sees (the first ones: windows closed at its position) and how
    # many its whole prompt has (the length of the reference's indexer row: the same
    # whatever the chunks, `ForwardBatch.seq_ends`)
    row_entries: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # by compress rate, per block (host): the end of the entries any of its rows may see
    # (flat entry index) and the most entries one of its rows sees
    seen: dict[int, list[tuple[int, int]]]
    prefix: PrefixPlan | None = None  # sequences that continue a cached prefix

    @classmethod
    def build(cls, batch: ForwardBatch, cp_rank: int, cfg: DeepseekV4Config,
              dtype: torch.dtype = torch.float32) -> "PrefillPlan":
        """`dtype`: the model's; with the kernel (`kernel_applies`) blocks can be larger."""
        split = batch.split
        assert split is not None
        device = batch.positions.device
        lens = [b - a for a, b in zip(split.cu_seqlens[:-1], split.cu_seqlens[1:])]
        rates = sorted({cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)} - {0})
        starts, prefix = _cached_starts(batch, lens), None
        # the reference's indexer row of a chunk's query: its whole prompt's entries
        ends = [max(e, st + n) for e, st, n in
                zip(batch.seq_ends or [0] * len(lens), starts, lens)]
        if any(starts):
            kv = batch.kv
            assert isinstance(kv, V4Cache) and batch.cache_keys is not None
            prefix = PrefixPlan.build(kv, batch.cache_keys, starts, lens, cfg, rates,
                                      kv.shard, device)
        firsts = [st - min(st, prefix_rows(cfg)) for st in starts]
        cu = [0]
        for n, st, f in zip(lens, starts, firsts):
            cu.append(cu[-1] + st - f + n)
        entries = {m: EntryIndex.build(cu, m, device, firsts, starts) for m in rates}
        seqs = split.local_token_to_seq(cp_rank)  # host copies of batch.token_to_seq
        starts_t = torch.tensor(starts, dtype=torch.int64)
        pos = split.local_positions(cp_rank) + starts_t[seqs]  # and of batch.positions
        T, W = seqs.numel(), cfg.sliding_window
        csa = entries.get(cfg.compress_rate_csa) if CSA in cfg.layer_types else None
        hca = entries.get(cfg.compress_rate_hca) if HCA in cfg.layer_types else None
        keys = W + max(cfg.index_topk if csa else 0, hca.offsets[-1] if hca else 0)
        step = rows_per_block(keys, cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads,
                              csa.offsets[-1] if csa else 0, kernel_applies(device, dtype))
        blocks = [(r0, min(r0 + step, T), int(seqs[r0]), int(seqs[min(r0 + step, T) - 1]) + 1)
                  for r0 in range(0, T, step)]
        row_entries, seen = {}, {}
        for m, ei in entries.items():
            first = torch.tensor(ei.offsets[:-1], dtype=torch.int64)[seqs]
            count = (pos + 1) // m
            end = first + count
            total = torch.tensor([e // m for e in ends], dtype=torch.int64)[seqs]
            row_entries[m] = (first.to(device), count.to(device), total.to(device))
            seen[m] = [(int(end[r0:r1].max()), int(count[r0:r1].max()))
                       for r0, r1, _, _ in blocks]
        firsts_t = torch.tensor(firsts, dtype=torch.int64, device=device)[batch.token_to_seq]
        cu_t = torch.tensor(cu[:-1], dtype=torch.int64, device=device)[batch.token_to_seq]
        return cls(cu, firsts, batch.token_to_seq, cu_t - firsts_t, firsts_t, blocks, entries,
                   row_entries, seen, prefix)


def _cached_starts(batch: ForwardBatch, lens: list[int]) -> list[int]:
    """Tokens each sequence held in the cache before this forward (the runner has counted
    the new ones already), 0 without a cache."""
    kv = batch.kv
    if not isinstance(kv, V4Cache) or batch.cache_keys is None:
        return [0] * len(lens)
    return [kv.seqs[key].length - n for key, n in zip(batch.cache_keys, lens)]


def sink_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] over per-row keys kv [T, N, D] (K = V) where valid [T, N]; each head's
    softmax also holds its sink logit, whose probability mass is dropped. fp32 math, fp64
    for fp32 inputs: the result then does not depend on N (how many masked keys a block's
    lists carry differs between batch compositions and CP layouts, and fp32 reductions
    order by shape)."""
    acc = torch.float64 if q.dtype == torch.float32 else torch.float32
    kvf = kv.to(acc)
    scores = torch.einsum("thd,tnd->thn", q.to(acc), kvf) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.to(acc).view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thn,tnd->thd", probs, kvf).to(q.dtype)


def prefill_attention(attn: DeepseekV4Attention, qs: Queries, k_side: torch.Tensor,
                      plan: PrefillPlan, rope: RotaryEmbedding, batch: ForwardBatch
                      ) -> torch.Tensor:
    """Layer `attn` for every local query row -> [T, Hq, D] (before the inverse RoPE and the
    output projection); with a cache, stores this CP rank's share of every sequence."""
    D, W, c = attn.head_dim, attn.window, attn.compressor
    lc = batch.kv.layers[attn.layer] if isinstance(batch.kv, V4Cache) else None
    if plan.prefix is not None:  # each sequence's cached rows ahead of its new ones
        assert lc is not None
        k_side = augment_rows(k_side, lc, plan.prefix)
    kv_N = k_side[:, :D]
    pool, N = kv_N, kv_N.shape[0]
    ent = index_keys = ei = None
    if c is not None:
        ei = plan.entries[c.rate]
        ent = c.pool_flat(k_side[:, D:D + 2 * c.width], ei.start_row, ei.window, rope)
        if plan.prefix is not None:
            assert lc is not None and lc.comp is not None
            ent = entries_with_prefix(ent, lc.comp.entries, plan.prefix.entries[c.rate],
                                      attn.groups.attn_cp)
        pool = torch.cat([kv_N, ent.to(kv_N.dtype)])
        if c.indexer is not None:
            index_keys = c.indexer.pool_flat(k_side[:, D + 2 * c.width:], ei.start_row,
                                             ei.window, rope)
            if plan.prefix is not None:
                assert lc is not None and lc.index is not None
                index_keys = entries_with_prefix(index_keys, lc.index.entries,
                                                 plan.prefix.entries[c.rate],
                                                 attn.groups.attn_cp)
    out = torch.empty_like(qs.q)
    kernel = kernel_applies(qs.q.device, qs.q.dtype)
    arange_w = torch.arange(W, device=kv_N.device)
    if c is not None:
        first, count, total = plan.row_entries[c.rate]  # [T] each
        arange_t = torch.arange(first.shape[0], device=first.device)
    for b, (r0, r1, s0, _) in enumerate(plan.blocks):
        r = slice(r0, r1)
        kpos = qs.pos[r][:, None] - (W - 1) + arange_w  # [rows, W]
        # rows before a sequence's first K-side row are never valid (a prefix's reach)
        idx = plan.row_base[r][:, None] + torch.maximum(kpos, plan.row_first[r][:, None])
        valid = kpos >= 0
        keys = None  # keys a row may see lie in its first `keys` (default: all)
        if c is not None and plan.seen[c.rate][b][1] > 0:
            e1, most = plan.seen[c.rate][b]
            if c.indexer is not None:  # CSA: the indexer's picks of the block's entries
                assert index_keys is not None
                e0 = ei.offsets[s0]
                lo = first[r] - e0
                picks = c.indexer.select_visible(qs.q_res[r], qs.x[r], qs.cos[r], qs.sin[r],
                                                 index_keys[e0:e1], lo, lo + count[r],
                                                 total[r], arange_t[r])
                cidx, cvalid = N + e0 + picks.clamp(min=0), picks >= 0
                keys = W + count[r].clamp(max=picks.shape[1])  # the visible picks lead
            else:  # HCA: every closed entry of the row's sequence, in order
                j = torch.arange(most, device=qs.pos.device)
                cvalid = j[None, :] < count[r][:, None]
                cidx = torch.where(cvalid, N + first[r][:, None] + j, N)
                keys = W + count[r]
            idx, valid = torch.cat([idx, cidx], dim=1), torch.cat([valid, cvalid], dim=1)
        if kernel:
            sparse_sink_attention(qs.q[r], pool, idx, valid, attn.sinks, attn.scale, out[r],
                                  lens=keys)
        else:
            out[r] = sink_attention(qs.q[r], pool[idx], valid, attn.sinks, attn.scale)
    if batch.kv is not None:
        _store(attn, plan, k_side, ent, index_keys, batch)
    return out


def _store(attn: DeepseekV4Attention, plan: PrefillPlan, k_side: torch.Tensor,
           ent: torch.Tensor | None, index_keys: torch.Tensor | None,
           batch: ForwardBatch) -> None:
    """Each sequence's state after its prompt into the static cache: the last rows of its
    window and compressor rings (by position) and this CP rank's share of its entries."""
    cp, D, c, kv = attn.groups.attn_cp, attn.head_dim, attn.compressor, batch.kv
    assert batch.cache_keys is not None and isinstance(kv, V4Cache)
    lc = kv.layers[attn.layer]
    for s, key in enumerate(batch.cache_keys):
        a, b = plan.cu[s], plan.cu[s + 1]
        slot = kv.seq_slot(key)
        f = plan.firsts[s]
        _write_ring(lc.window, slot, k_side[a:b, :D], f)
        if c is None:
            continue
        ei = plan.entries[c.rate]
        e0, e1 = ei.offsets[s], ei.offsets[s + 1]
        mine = torch.tensor(kv.own_entries(key, c.rate, ei.counts[s]), dtype=torch.int64,
                            device=k_side.device)
        assert ent is not None and lc.comp is not None
        _write_ring(lc.comp.rows, slot, k_side[a:b, D:D + 2 * c.width], f)
        lc.comp.entries[mine] = ent[e0:e1][cp.rank::cp.size].to(lc.comp.entries.dtype)
        if c.indexer is not None:
            assert index_keys is not None and lc.index is not None
            _write_ring(lc.index.rows, slot, k_side[a:b, D + 2 * c.width:], f)
            lc.index.entries[mine] = index_keys[e0:e1][cp.rank::cp.size].to(
                lc.index.entries.dtype)


def _write_ring(ring_SRF: torch.Tensor, slot: int, rows_LF: torch.Tensor, first: int) -> None:
    """Rows of positions first..first+L-1 of one sequence -> its ring (position p at p % R);
    the last R are kept."""
    L, R = rows_LF.shape[0], ring_SRF.shape[1]
    keep = min(L, R)
    pos = torch.arange(first + L - keep, first + L, device=rows_LF.device)
    ring_SRF[slot, pos % R] = rows_LF[L - keep:].to(ring_SRF.dtype)
