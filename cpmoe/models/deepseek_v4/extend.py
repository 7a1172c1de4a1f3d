"""DeepSeek-V4 extend after a cached prefix: what a prompt chunk reads of the state its
sequence's earlier chunks left in `V4Cache`, so that chunked prefill gives the logits of the
whole prompt.

A chunk of sequence s holds positions [start, start + L). Its attention needs, besides its
own rows:
- the KV rows of the last W-1 positions before `start` (sliding window) and the projected
  compressor / indexer rows of the windows still open at `start` (with overlap also the
  window before): all of them lie in the per-sequence rings (`LayerCache.window`,
  `CompressorPool.rows`, the row of position p at p % R), replicated on every CP rank. The
  plan prepends P = min(start, PREFIX_ROWS) such rows to the sequence's K-side rows, so the
  prefill code sees one run of positions [start - P, start + L) per sequence; rows older
  than a ring's reach are never read (a query at p reads the window from p - W + 1 >=
  start - W + 1, a new entry's window starts at >= start - 2m + 1);
- every compressed entry and indexer key closed before `start` (start // m of them per
  rate), CP-sharded in the cache (entry c on rank c % cp): each rank reads the ones it holds,
  ONE all-gather per layer and series lays them out in entry order, and they take their
  places ahead of the chunk's new entries. The indexer's top-k then runs over the sequence's
  entries so far, in entry order, as decode's does (`topk_as_reference` over its row).

`PrefixPlan` holds the host-built indices (built once per forward, shared by the layers);
`augment_rows` and `entries_with_prefix` apply them in a layer.

Legend: N = flat K-side rows of the new tokens, Pt = prefix rows of the batch, Lt = this
rank's slots of prefix entries of the batch (padded per sequence to ceil(n / cp)), E = all
entries of the batch (prefix and new).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config
from cpmoe.models.deepseek_v4.state import LayerCache
from cpmoe.parallel import comm
from cpmoe.parallel.groups import Group


def prefix_rows(cfg: DeepseekV4Config) -> int:
    """Rows before a chunk its attention may read: the window's W-1 and the longest open
    compressor span (2m - 1 with overlap, m - 1 without)."""
    spans = [cfg.sliding_window - 1]
    if CSA in cfg.layer_types:
        spans.append(2 * cfg.compress_rate_csa - 1)
    if HCA in cfg.layer_types:
        spans.append(cfg.compress_rate_hca - 1)
    return max(spans)


@dataclass
class PrefixEntries:
    """One compress rate's prefix entries of the batch: `slots` [Lt] this rank's cache slots
    of them (the trash slot in padding), `order` [E] each entry of the batch as a row of
    [all-gathered prefix entries (cp * Lt) ; the forward's new entries]."""

    slots: torch.Tensor
    order: torch.Tensor


@dataclass
class PrefixPlan:
    slot: torch.Tensor  # [Pt] sequence slot of each prefix row
    pos: torch.Tensor  # [Pt] its position
    rows: torch.Tensor  # [N + Pt] -> augmented rows: index into [K side ; prefix rows]
    entries: dict[int, PrefixEntries]  # by compress rate

    @classmethod
    def build(cls, kv, keys: list[int], starts: list[int], lens: list[int],
              cfg: DeepseekV4Config, rates: list[int], cp: tuple[int, int],
              device: torch.device) -> "PrefixPlan":
        """kv: the `V4Cache` (its books give the slots); starts[s] cached tokens and lens[s]
        new ones of sequence s; cp = (rank, size) of the entry shards."""
        cp_rank, cp_size = cp
        reach = prefix_rows(cfg)
        n_new = sum(lens)
        slot, pos, rows = [], [], []
        at_new, at_pref = 0, n_new
        for key, start, n in zip(keys, starts, lens):
            p = min(start, reach)
            if p:
                slot += [kv.seq_slot(key)] * p
                pos += range(start - p, start)
                rows += range(at_pref, at_pref + p)
                at_pref += p
            rows += range(at_new, at_new + n)
            at_new += n
        entries = {}
        for m in rates:
            slots: list[int] = []
            order: list[torch.Tensor] = []
            per_rank = [-(-(st // m) // cp_size) for st in starts]
            total_local = sum(per_rank)
            new_at = cp_size * total_local
            off = 0
            for key, start, n, width in zip(keys, starts, lens, per_rank):
                held = kv.own_entries(key, m, start // m) if width else []
                slots += held + [kv.trash_entry[m]] * (width - len(held))
                c = torch.arange(start // m)  # entry c: row c // cp of rank c % cp's part
                order.append((c % cp_size) * total_local + off + c // cp_size)
                fresh = (start + n) // m - start // m
                order.append(torch.arange(new_at, new_at + fresh))
                new_at += fresh
                off += width
            entries[m] = PrefixEntries(_on(slots, device), torch.cat(order).to(device))
        return cls(_on(slot, device), _on(pos, device), _on(rows, device), entries)


def _on(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64).to(device)


def augment_rows(k_side: torch.Tensor, lc: LayerCache, plan: PrefixPlan) -> torch.Tensor:
    """The forward's K-side rows [N, F] -> [N + Pt, F], each sequence's prefix rows (from
    the rings: the KV row, then the compressor's and the indexer's projected rows, the
    K side's columns) ahead of its new rows."""
    parts = [lc.window[plan.slot, plan.pos % lc.window.shape[1]]]
    for pool in (lc.comp, lc.index):
        if pool is not None:
            parts.append(pool.rows[plan.slot, plan.pos % pool.rows.shape[1]])
    prefix = torch.cat(parts, dim=-1).to(k_side.dtype)
    return torch.cat([k_side, prefix])[plan.rows]


def entries_with_prefix(new_Ed: torch.Tensor, cached_Xd: torch.Tensor, pe: PrefixEntries,
                        cp: Group) -> torch.Tensor:
    """The forward's new entries [E_new, d] and the cache's entry pool of one series on this
    rank -> every entry of the batch [E, d] in flat order (prefix entries gathered over CP,
    one all-gather, every rank the same)."""
    local = cached_Xd[pe.slots].to(new_Ed.dtype)
    gathered = comm.all_gather(local, cp)
    return torch.cat([gathered, new_Ed])[pe.order]
