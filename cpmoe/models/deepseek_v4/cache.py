"""The DeepSeek-V4 decode cache of one CP rank and its size rule.

Per sequence: the sliding window's last W-1 KV rows and the still-open compressor rows
(replicated on every CP rank, bounded), and this rank's share of the compressed KV entries
and indexer keys (entry c on CP rank c % cp_size). All of it lives in tensors allocated once
(`LayerCache`, deepseek_v4/state.py): each sequence owns a slot of the window and row rings
(`max_seqs` slots, the next one is the trash slot of padded rows) and pages of
`ENTRY_PAGE` entries in one pool per layer (one page list per compress rate: layers of a
rate close windows at the same tokens). The host keeps the books (slots, pages, counts,
all following from lengths every rank knows) and hands a decode step its indices as a
`DecodeStep`, so the step itself runs without host syncs and without per-sequence work.

Token accounting (capacity, per-sequence lengths) is the runner's `PagedKVCache` with
one-token pages and no K/V pools, kept the same on every rank (`cp_size` 1 there: the
runner treats the cache as the model's own and every rank sees every decode row).

`sequence_bytes` is the exact size rule of the live data (tests compare it with
`nbytes_used`, whose sharded part counts the entries this rank really holds); the rings are
reserved per sequence slot up front (`reserved_bytes`); `plan` prints `cache_summary`.
`cache_bytes` is the size of the whole allocation (rings of every slot, entry pools, page
tables) for a capacity and slot count, `tokens_for_bytes` the largest capacity a byte budget
allows: --mem-fraction-static sizes this cache as it sizes Qwen's pages. The slot count
(`max_seqs`, --max-running-requests) caps the scheduler's admissions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.cp.kv_cache import CacheFullError, PagedKVCache
from cpmoe.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from cpmoe.models.deepseek_v4.state import ENTRY_PAGE, CompressorPool, DecodeStep, LayerCache

DEFAULT_MAX_SEQS = 256  # sequence slots (the engine's default --max-running-requests)


def _owned(total: int, cp_rank: int, cp_size: int) -> int:
    """Entries c < total with c % cp_size == cp_rank."""
    return max(0, (total - cp_rank + cp_size - 1) // cp_size)


def sequence_bytes(cfg: DeepseekV4Config, tokens: int, cp_rank: int, cp_size: int,
                   elem: int) -> dict[str, int]:
    """Bytes CP rank cp_rank stores for one sequence of `tokens` positions: 'sharded'
    (compressed entries and indexer keys), 'window' (sliding-window rows) and 'open'
    (projected rows of compressor windows not yet closed)."""
    out = {"sharded": 0, "window": 0, "open": 0}
    D, dI = cfg.head_dim, cfg.index_head_dim
    for layer, kind in enumerate(cfg.layer_types):
        out["window"] += min(tokens, cfg.sliding_window - 1) * D * elem
        if kind == SLIDING:
            continue
        m = cfg.compress_rate(layer)
        total = tokens // m
        series = [(D, kind == CSA)] + ([(dI, True)] if kind == CSA else [])
        for dim, overlap in series:
            width = (2 if overlap else 1) * dim
            rows_from = max(total - 1, 0) * m if overlap else total * m
            out["sharded"] += _owned(total, cp_rank, cp_size) * dim * elem
            out["open"] += (tokens - rows_from) * 2 * width * elem
    return out


def cache_summary(cfg: DeepseekV4Config, cp_size: int, dtype: torch.dtype,
                  tokens: int = 4096) -> str:
    """One line for `cpmoe plan`: what each CP rank stores in decode."""
    elem = torch.empty((), dtype=dtype).element_size()
    one = sequence_bytes(cfg, tokens, 0, 1, elem)
    ranks = [sequence_bytes(cfg, tokens, r, cp_size, elem) for r in range(cp_size)]
    busiest = max(sum(b.values()) for b in ranks)
    per_token = sequence_bytes(cfg, 1 << 20, 0, 1, elem)["sharded"] / (1 << 20)
    return (f"DeepSeek-V4 decode cache sharded over {cp_size} CP rank(s): compressed KV and "
            f"indexer keys round-robin by entry (~{per_token / cp_size:.0f} bytes per context "
            f"token per rank, {per_token:.0f} on one rank), sliding window and open compressor "
            f"windows replicated (<= {_bounded_bytes(cfg, elem)} bytes per sequence); a "
            f"{tokens}-token sequence: {busiest} bytes on the busiest rank, "
            f"{sum(one.values())} on one rank ({dtype_name(dtype)})")


def _bounded_bytes(cfg: DeepseekV4Config, elem: int) -> int:
    """The largest replicated part of one sequence (window plus open rows)."""
    worst = 0
    for tokens in range(1, 2 * max(cfg.compress_rate_hca, cfg.compress_rate_csa) + 1):
        b = sequence_bytes(cfg, tokens + cfg.sliding_window, 0, 1, elem)
        worst = max(worst, b["window"] + b["open"])
    return worst


def _rates(cfg: DeepseekV4Config) -> list[int]:
    return sorted({cfg.compress_rate(i) for i in range(cfg.num_hidden_layers)} - {0})


def entry_pages(cfg: DeepseekV4Config, capacity: int, max_seqs: int, cp_size: int
                ) -> dict[int, int]:
    """Pages a rate can need: every local entry of every sequence plus one partly filled
    page per sequence (local entries of a sequence <= its tokens / (m cp) + 1)."""
    return {m: -(-(capacity // (m * cp_size) + max_seqs) // ENTRY_PAGE) + max_seqs
            for m in _rates(cfg)}


def table_columns(pages: dict[int, int], capacity: int, cp_size: int) -> dict[int, int]:
    """Page-table columns per rate: the pages of one sequence of `capacity` tokens."""
    return {m: min(n, -(-_owned(capacity // m, 0, cp_size) // ENTRY_PAGE) + 1)
            for m, n in pages.items()}


def cache_bytes(cfg: DeepseekV4Config, capacity: int, max_seqs: int, cp_size: int,
                elem: int) -> int:
    """Bytes of every tensor a `V4Cache` of these sizes allocates on one rank: the rings of
    max_seqs + 1 slots (window, open compressor rows), the entry pools and the int64 page
    tables (the shapes of `V4Cache._layer_cache`)."""
    S, D, dI = max_seqs + 1, cfg.head_dim, cfg.index_head_dim
    pages = entry_pages(cfg, capacity, max_seqs, cp_size)
    total = sum(S * c * 8 for c in table_columns(pages, capacity, cp_size).values())
    for layer, kind in enumerate(cfg.layer_types):
        total += S * cfg.sliding_window * D * elem
        if kind == SLIDING:
            continue
        m = cfg.compress_rate(layer)
        for dim, overlap in [(D, kind == CSA)] + ([(dI, True)] if kind == CSA else []):
            width, ring = (2 if overlap else 1) * dim, (2 if overlap else 1) * m
            total += (S * ring * 2 * width + (pages[m] + 1) * ENTRY_PAGE * dim) * elem
    return total


def tokens_for_bytes(cfg: DeepseekV4Config, budget: int, max_seqs: int, cp_size: int,
                     elem: int) -> int:
    """The largest capacity (token slots) whose `cache_bytes` fits `budget`, 0 when not
    even the per-slot rings do (what --mem-fraction-static leaves sizes the cache)."""
    if cache_bytes(cfg, 1, max_seqs, cp_size, elem) > budget:
        return 0
    lo, hi = 1, 2
    while cache_bytes(cfg, hi, max_seqs, cp_size, elem) <= budget and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # cache_bytes grows with capacity: bisect the last that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cache_bytes(cfg, mid, max_seqs, cp_size, elem) <= budget else (
            lo, mid)
    return lo


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class DecodeMeta:
    """A decode step's indices on the host (what `DecodeStep` holds on the device)."""

    seq_slot: list[int]
    write: dict[int, list[int]]  # rate -> entry slot per row
    count: dict[int, list[int]]  # rate -> local entries per row
    widths: dict[int, int]  # rate -> most pages of a row

    def tensors(self, rows: int, widths: dict[int, int], trash_seq: int,
                trash_entry: dict[int, int]) -> DecodeStep:
        """CPU tensors of `rows` rows (the rows past this step's: trash slot, count 0)."""
        pad = rows - len(self.seq_slot)

        def col(values: list[int], fill: int) -> torch.Tensor:
            return torch.tensor(values + [fill] * pad, dtype=torch.int64)

        return DecodeStep(col(self.seq_slot, trash_seq),
                          {m: col(w, trash_entry[m]) for m, w in self.write.items()},
                          {m: col(c, 0) for m, c in self.count.items()}, widths)


class V4Cache(PagedKVCache):
    """Token accounting plus the static storage of this CP rank's share of every sequence
    (see the module docstring)."""

    def __init__(self, cfg: DeepseekV4Config, capacity: int, dtype: torch.dtype,
                 device: torch.device, shard: tuple[int, int] = (0, 1),
                 max_seqs: int | None = None) -> None:
        super().__init__(0, capacity, 1, 1, 1, dtype, device)
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.shard = shard  # (cp_rank, cp_size) of the compressed entries held here
        cp_size = shard[1]
        self.max_seqs = min(max_seqs or DEFAULT_MAX_SEQS, capacity)
        self.trash_seq = self.max_seqs
        self.rates = _rates(cfg)
        self.num_entry_pages = entry_pages(cfg, capacity, self.max_seqs, cp_size)
        self.trash_entry = {m: n * ENTRY_PAGE for m, n in self.num_entry_pages.items()}
        self.layers = [self._layer_cache(i) for i in range(cfg.num_hidden_layers)]
        # Page ids of every slot's local entries (column j: entries j*ENTRY_PAGE ..), on the
        # device, so a step reads its rows' pages there; written when a page is taken. A
        # sequence holds at most `capacity` tokens.
        cols = table_columns(self.num_entry_pages, capacity, cp_size)
        self.page_table = {m: torch.zeros(self.max_seqs + 1, c, dtype=torch.int64,
                                          device=device) for m, c in cols.items()}
        self._new_pages: list[tuple[int, int, int, int]] = []  # (rate, slot, column, page)
        self._free_slots = list(range(self.max_seqs - 1, -1, -1))
        self._free_entry_pages = {m: list(range(n - 1, -1, -1))
                                  for m, n in self.num_entry_pages.items()}
        self.slot: dict[int, int] = {}  # sequence key -> slot
        self.entry_pages: dict[int, dict[int, list[int]]] = {}  # key -> rate -> pages
        self.local_entries: dict[int, dict[int, int]] = {}  # key -> rate -> entries held

    def _layer_cache(self, layer: int) -> LayerCache:
        cfg, S = self.cfg, self.max_seqs + 1
        D, dI, kind = cfg.head_dim, cfg.index_head_dim, cfg.layer_types[layer]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        def pool(m: int, dim: int, overlap: bool) -> CompressorPool:
            width = (2 if overlap else 1) * dim
            ring = (2 if overlap else 1) * m
            return CompressorPool(zeros(S, ring, 2 * width),
                                  zeros((self.num_entry_pages[m] + 1) * ENTRY_PAGE, dim))

        comp = index = None
        if kind != SLIDING:
            m = cfg.compress_rate(layer)
            comp = pool(m, D, kind == CSA)
            index = pool(m, dI, True) if kind == CSA else None
        return LayerCache(zeros(S, cfg.sliding_window, D), comp, index)

    # ---- host books ---------------------------------------------------------------------
    def seq_slot(self, key: int) -> int:
        """The sequence's slot, taken on first use."""
        if key not in self.slot:
            if not self._free_slots:
                raise CacheFullError(f"DeepSeek-V4 cache: all {self.max_seqs} sequence slots "
                                     f"are in use (--max-running-requests)")
            self.slot[key] = self._free_slots.pop()
            self.entry_pages[key] = {m: [] for m in self.rates}
            self.local_entries[key] = {m: 0 for m in self.rates}
        return self.slot[key]

    def own_entries(self, key: int, rate: int, total: int) -> list[int]:
        """The sequence has `total` entries at `rate`: slots of every one of them this rank
        owns (entry c on rank c % cp_size), in entry order."""
        held = self._take(key, rate, total)
        pages = self.entry_pages[key][rate]
        return [self._entry_slot(pages, j) for j in range(held)]

    def _take(self, key: int, rate: int, total: int) -> int:
        """Take slots for the entries of `total` this rank owns and does not hold yet ->
        entries held."""
        self.seq_slot(key)
        cp_rank, cp_size = self.shard
        have, want = self.local_entries[key][rate], _owned(total, cp_rank, cp_size)
        pages = self.entry_pages[key][rate]
        for j in range(have, want):
            if j % ENTRY_PAGE == 0:
                if not self._free_entry_pages[rate]:
                    raise CacheFullError(f"DeepSeek-V4 cache: no free page of rate-{rate} "
                                         f"entries (--max-total-tokens)")
                pages.append(self._free_entry_pages[rate].pop())
                self._new_pages.append((rate, self.slot[key], len(pages) - 1, pages[-1]))
        self.local_entries[key][rate] = held = max(have, want)
        return held

    @staticmethod
    def _entry_slot(pages: list[int], j: int) -> int:
        return pages[j // ENTRY_PAGE] * ENTRY_PAGE + j % ENTRY_PAGE

    def prepare_decode(self, keys: list[int]) -> DecodeMeta:
        """The books of one decode step (each row's token already counted by
        `append_decode`): entries the new tokens close are taken on their owner rank, and
        the pages taken since the last step are written to the device page table."""
        meta = DecodeMeta([], {m: [] for m in self.rates}, {m: [] for m in self.rates},
                          {m: 1 for m in self.rates})
        for key in keys:
            end = self.seqs[key].length  # the new token's position + 1
            meta.seq_slot.append(self.seq_slot(key))
            for m in self.rates:
                before = self.local_entries[key][m]
                held = self._take(key, m, end // m)
                pages = self.entry_pages[key][m]
                meta.write[m].append(self._entry_slot(pages, held - 1) if held > before
                                     else self.trash_entry[m])
                meta.count[m].append(held)
                meta.widths[m] = max(meta.widths[m], len(pages))
        self._write_new_pages()
        return meta

    def _write_new_pages(self) -> None:
        for m in self.rates:
            new = [(s, c, p) for r, s, c, p in self._new_pages if r == m]
            if new:
                idx = torch.tensor(new, dtype=torch.int64).T.to(self.device)
                self.page_table[m][idx[0], idx[1]] = idx[2]
        self._new_pages.clear()

    def decode_step(self, keys: list[int]) -> DecodeStep:
        """`prepare_decode` as device tensors (eager steps: the rows' own page widths)."""
        meta = self.prepare_decode(keys)
        step = meta.tensors(len(keys), meta.widths, self.trash_seq, self.trash_entry)
        return DecodeStep(step.seq_slot.to(self.device),
                          {m: t.to(self.device) for m, t in step.write.items()},
                          {m: t.to(self.device) for m, t in step.count.items()}, step.widths)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        slot = self.slot.pop(seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._new_pages = [e for e in self._new_pages if e[1] != slot]
            for m, pages in self.entry_pages.pop(seq_id).items():
                self._free_entry_pages[m].extend(reversed(pages))
            self.local_entries.pop(seq_id)

    # ---- sizes --------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Growth per context token on this rank (compressed entries, amortised, 1/cp of one
        rank's); the window and open-window rows are a bounded constant per sequence."""
        c, per = self.cfg, 0.0
        for kind in c.layer_types:
            if kind == CSA:
                per += (c.head_dim + c.index_head_dim) / c.compress_rate_csa
            elif kind == HCA:
                per += c.head_dim / c.compress_rate_hca
        elem = torch.empty((), dtype=self.dtype).element_size()
        return int(per * elem / self.shard[1])

    def nbytes_used(self) -> int:
        """Bytes of live data this rank holds for its sequences: the entries it really holds
        (from its books) plus the window and open rows their lengths keep."""
        cfg, elem = self.cfg, torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for key in self.slot:
            rule = sequence_bytes(cfg, self.seqs[key].length, *self.shard, elem)
            total += rule["window"] + rule["open"]
            for layer, kind in enumerate(cfg.layer_types):
                if kind != SLIDING:
                    held = self.local_entries[key][cfg.compress_rate(layer)]
                    total += held * elem * (cfg.head_dim
                                            + (cfg.index_head_dim if kind == CSA else 0))
        return total

    def reserved_bytes(self) -> int:
        """Bytes of every tensor allocated (rings of every slot, whole entry pools)."""
        parts = [t for lc in self.layers for t in [lc.window] + [
            x for p in (lc.comp, lc.index) if p is not None for x in (p.rows, p.entries)]]
        return sum(t.numel() * t.element_size() for t in parts)

    def step_read_bytes(self, lengths: list[int]) -> int:
        """Cache bytes a decode step must read on this rank for rows of `lengths` tokens
        (before the step): per layer the window's W rows; HCA every entry this rank holds;
        CSA every indexer key it holds and its share (1/cp) of the top-k entries."""
        cfg, (cp_rank, cp_size) = self.cfg, self.shard
        D, dI = cfg.head_dim, cfg.index_head_dim
        rows = 0
        for n in lengths:
            for layer, kind in enumerate(cfg.layer_types):
                rows += min(n + 1, cfg.sliding_window) * D
                if kind == SLIDING:
                    continue
                total = (n + 1) // cfg.compress_rate(layer)
                held = _owned(total, cp_rank, cp_size)
                if kind == HCA:
                    rows += held * D
                else:
                    rows += held * dI + -(-min(cfg.index_topk, total) // cp_size) * D
        return rows * torch.empty((), dtype=self.dtype).element_size()
