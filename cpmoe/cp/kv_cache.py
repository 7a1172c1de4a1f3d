"""The paged KV cache of one rank, sharded over attention context parallelism (CP).

Pools: one K and one V tensor per layer, `[num_pages + 1, page_size, Hkv, D]`. Pages
`0..num_pages-1` hold tokens; the last page is a trash page that absorbs writes nobody reads
(decode rows another CP rank stores, padded rows of a captured CUDA graph), so a step's
writes never need a host-side branch.

Sharding (the owner rule): each CP rank stores only its own tokens of every sequence.
- Prefill / chunked prefill: the tokens the CP split of the chunk gives this rank.
- Decode: the new token goes to the CP rank holding the fewest tokens of the sequence (ties:
  lowest rank). Shards stay within one token of each other beyond the split's own imbalance,
  so every rank reads ~1/cp of a sequence's KV per step. (A page-granular round robin has
  the same page waste, at most one partly filled page per sequence per rank, but lets shards
  drift apart by a page: more read on the busiest rank for nothing.)
A sequence's tokens on a rank fill its pages in arrival order. Positions never matter to
attention over stored keys: every stored key precedes the queries that read it (a decode
row's own key is written before it is read; a chunk's own keys are attended separately).

Bookkeeping is all here: page allocation, per-sequence page lists, the owner rule, capacity
checks and the refusal message. Every rank tracks the token counts *and the page lists* of
every CP rank for every sequence (they follow from information all ranks share: every rank
runs every rank's allocator), so any rank -- the scheduler's -- knows every rank's page use
without communication, and ranks never diverge.

Prefix sharing (the radix cache, engine/radix.py): `fork(new, src, n)` makes a sequence
whose first n tokens are those of `src`. Each rank stores its tokens of a sequence in
increasing position order, so the tokens of positions < n on rank r are the first c_r of
its list (`owners`, the CP rank of every position, gives c_r): the whole pages among them
are shared (reference counts per page), and the c_r % page_size tokens of a partly covered
page are copied into a fresh page on the rank that holds them (no communication). The
cached prefix stays where the split first put it: no rank holds more of it than before.
A page returns to the free list when no sequence references it.

Legend: P = pages, S = page_size, Hkv = local KV heads, D = head dim, B = batch rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpmoe.cp.kv_capacity import pages_for, split_owners
from cpmoe.cp.split import balancing_rotation, rank_counts

# --kv-cache-dtype (SGLang's values): the pools' dtype; auto: the model's. FP8 pools hold
# K / k_scale and V / v_scale, saturating (`ops.to_kv_cache` writes them; the scales are the
# checkpoint's per layer, else 1) and attention widens them back to the model's dtype times
# the scale as it reads them (`widen_kv`)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


def pool_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool [slots, ...] rows at `slots`, in the pool's dtype; an FP8 pool's through its
    bytes (a uint8 gather, which every device's index kernel takes)."""
    if pool.dtype.itemsize == 1 and pool.dtype.is_floating_point:
        return pool.view(torch.uint8)[slots].view(pool.dtype)
    return pool[slots]


def widen_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Pool values -> `dtype`: FP8 codes times their scale (a 0-d float32 tensor; None: 1)
    rounded once to `dtype`, as the decode kernel widens them; 16-bit values as they are."""
    if scale is None or x.dtype.itemsize != 1:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' dtype for --kv-cache-dtype `name`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: expected one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


class CacheFullError(RuntimeError):
    """Work that does not fit the KV cache; the message names --max-total-tokens."""


@dataclass
class SeqPages:
    counts: list[int]  # tokens stored on each CP rank
    rank_pages: list[list[int]]  # every CP rank's pages, in fill order (mirrored)
    owners: bytearray | None = None  # CP rank of each stored position (None: unknown)
    cached: bool = False  # a finished request's sequence kept for its prefix (evictable)
    pages: list[int] = field(default_factory=list)  # this rank's: rank_pages[cp_rank]

    @property
    def length(self) -> int:
        """Tokens of the sequence stored over all CP ranks (= the next position)."""
        return sum(self.counts)


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, cp_size: int = 1,
                 cp_rank: int = 0, strategy: str = "zigzag") -> None:
        if num_pages < 1 or page_size < 1:
            raise CacheFullError(f"KV cache of {num_pages} pages of {page_size} tokens: need "
                                 f"at least one page (--max-total-tokens, --page-size)")
        self.num_pages, self.page_size = num_pages, page_size
        self.cp_size, self.cp_rank, self.strategy = cp_size, cp_rank, strategy
        shape = (num_pages + 1, page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.trash_slot = num_pages * page_size  # first slot of the trash page
        # every CP rank's free list and page reference counts (mirrored: all ranks run every
        # rank's allocator); pop() hands out low pages first
        self._free = [list(range(num_pages - 1, -1, -1)) for _ in range(cp_size)]
        self._refs = [[0] * num_pages for _ in range(cp_size)]
        self._live = [[0] * num_pages for _ in range(cp_size)]  # refs from uncached seqs
        self.cached_pages = [0] * cp_size  # pages only cached sequences hold (evictable)
        self.rank_pages = [0] * cp_size  # pages in use on every CP rank (mirrored)
        self.seqs: dict[int, SeqPages] = {}

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Token slots per rank (--max-total-tokens)."""
        return self.num_pages * self.page_size

    @property
    def used(self) -> int:
        """Token slots held by this rank's pages (whole pages)."""
        return self.rank_pages[self.cp_rank] * self.page_size

    @property
    def tokens_stored(self) -> int:
        return sum(s.counts[self.cp_rank] for s in self.seqs.values())

    def bytes_per_token(self) -> int:
        if not self.k:
            return 0
        return 2 * len(self.k) * self.k[0][0, 0].numel() * self.k[0].element_size()

    def nbytes_used(self) -> int:
        """Bytes of the pages this rank holds."""
        return self.used * self.bytes_per_token()

    def free_pages(self, cp_rank: int) -> int:
        return self.num_pages - self.rank_pages[cp_rank]

    # ---- allocation ---------------------------------------------------------------------------
    def pages_to_grow(self, counts: list[int], new: list[int]) -> list[int]:
        """Pages each CP rank needs to store `new` more tokens of a sequence at `counts`."""
        ps = self.page_size
        return [pages_for(c + n, ps) - pages_for(c, ps) for c, n in zip(counts, new)]

    def extend_pages_needed(self, key: int | None, new: list[int]) -> list[int]:
        counts = self.seqs[key].counts if key in self.seqs else [0] * self.cp_size
        return self.pages_to_grow(counts, new)

    def fits(self, need: list[int]) -> bool:
        return all(n <= self.free_pages(r) for r, n in enumerate(need))

    def pages_held(self, key: int) -> list[int]:
        """Pages sequence `key` holds on each CP rank (zeros for an unknown key)."""
        seq = self.seqs.get(key)
        if seq is None:
            return [0] * self.cp_size
        return [pages_for(c, self.page_size) for c in seq.counts]

    def rotation(self, key: int | None, tokens: int, strategy: str) -> int:
        """The split rotation of `tokens` new tokens of sequence `key` (None: a new one)."""
        if key is None or key not in self.seqs:
            return 0
        return balancing_rotation(self.seqs[key].counts, tokens, strategy)

    def new_counts(self, key: int | None, tokens: int, strategy: str) -> list[int]:
        """Tokens each CP rank stores of `tokens` new tokens of sequence `key` (None: a new
        one) split in one piece, as an extend step splits them."""
        return rank_counts(tokens, self.cp_size, strategy, self.rotation(key, tokens, strategy))

    def _new_seq(self, counts: list[int], owners: bytearray | None) -> SeqPages:
        rank_pages: list[list[int]] = [[] for _ in range(self.cp_size)]
        return SeqPages(list(counts), rank_pages, owners, pages=rank_pages[self.cp_rank])

    def _alloc(self, r: int) -> int:
        page = self._free[r].pop()
        self._refs[r][page] = 1
        self._live[r][page] = 1
        self.rank_pages[r] += 1
        return page

    def extend(self, key: int, new: list[int]) -> list[int]:
        """Store new[r] more tokens of sequence `key` on each CP rank r (a new key starts
        empty) -> the slots of this rank's new tokens, in arrival order."""
        seq = self.seqs.get(key) or self._new_seq([0] * self.cp_size, bytearray())
        need = self.pages_to_grow(seq.counts, new)
        if not self.fits(need):
            ranks = [r for r in range(self.cp_size) if need[r] > self.free_pages(r)]
            r = ranks[0]
            raise CacheFullError(f"KV cache full: sequence {key} needs {need[r]} more pages of "
                                 f"{self.page_size} tokens on CP rank {r}, "
                                 f"{self.free_pages(r)} of {self.num_pages} free "
                                 f"(--max-total-tokens {self.capacity})")
        if seq.owners is not None and self.cp_size > 1:
            n = sum(new)
            owners = split_owners(n, self.cp_size, self.strategy,
                                  balancing_rotation(seq.counts, n, self.strategy))
            if [owners.count(r) for r in range(self.cp_size)] == list(new):
                seq.owners += owners
            else:  # not a split of this cache's strategy: the prefix cannot be shared
                seq.owners = None
        self.seqs[key] = seq
        for r in range(self.cp_size):
            seq.rank_pages[r] += [self._alloc(r) for _ in range(need[r])]
        start, n = seq.counts[self.cp_rank], new[self.cp_rank]
        seq.counts = [c + d for c, d in zip(seq.counts, new)]
        ps = self.page_size
        return [seq.pages[t // ps] * ps + t % ps for t in range(start, start + n)]

    # ---- prefix sharing -------------------------------------------------------------------------
    def can_fork(self, key: int) -> bool:
        seq = self.seqs.get(key)
        return seq is not None and (self.cp_size == 1 or seq.owners is not None)

    def fork_counts(self, src: int, tokens: int) -> list[int]:
        """Tokens of positions < `tokens` of sequence `src` that each CP rank stores."""
        if self.cp_size == 1:
            return [tokens]
        owners = self.seqs[src].owners
        assert owners is not None and tokens <= len(owners)
        head = bytes(owners[:tokens])
        return [head.count(r) for r in range(self.cp_size)]

    def fork_pages_needed(self, src: int, tokens: int) -> list[int]:
        """New pages each CP rank needs to fork `tokens` tokens of `src`: one for a partly
        covered page (its tokens are copied), none for whole ones (shared)."""
        return [1 if c % self.page_size else 0 for c in self.fork_counts(src, tokens)]

    def fork(self, key: int, src: int, tokens: int) -> None:
        """A new sequence `key` holding the first `tokens` tokens of `src`: whole pages are
        shared, the tokens of a partly covered page are copied into a new page."""
        self.fork_many([(key, src, tokens)])

    def fork_many(self, forks: list[tuple[int, int, int]]) -> None:
        """`fork` of each (key, src, tokens) in turn, the partly covered pages of all of them
        copied at once (one copy per pool, not one per fork and pool)."""
        copies = [c for key, src, tokens in forks for c in self._fork(key, src, tokens)]
        assert not {s for s, _ in copies} & {d for _, d in copies}, "fork of a fork: one step"
        if copies:
            src, dst = torch.tensor(copies, dtype=torch.int64).t().to(self.k[0].device)
            for pool in (*self.k, *self.v):
                pool[dst] = pool[src]  # whole pages: slots past the fork are written first

    def _fork(self, key: int, src: int, tokens: int) -> list[tuple[int, int]]:
        """The bookkeeping of `fork` -> (source page, new page) to copy on this rank."""
        if key in self.seqs:
            raise ValueError(f"sequence {key} exists already")
        need = self.fork_pages_needed(src, tokens)
        if not self.fits(need):
            r = max(range(self.cp_size), key=lambda r: need[r] - self.free_pages(r))
            raise CacheFullError(f"KV cache full: a cached prefix needs a page on CP rank {r}, "
                                 f"{self.free_pages(r)} of {self.num_pages} free "
                                 f"(--max-total-tokens {self.capacity})")
        source, ps = self.seqs[src], self.page_size
        counts = self.fork_counts(src, tokens)
        owners = None if source.owners is None else source.owners[:tokens]
        seq = self._new_seq(counts, owners)
        copies = []
        for r, c in enumerate(counts):
            shared = source.rank_pages[r][:c // ps]
            for page in shared:
                self._refs[r][page] += 1
                self._live[r][page] += 1
                if self._live[r][page] == 1:
                    self.cached_pages[r] -= 1
            seq.rank_pages[r] += shared
            if c % ps:
                page = self._alloc(r)
                seq.rank_pages[r].append(page)
                if r == self.cp_rank:
                    copies.append((source.rank_pages[r][c // ps], page))
        self.seqs[key] = seq
        return copies

    def pages_freed(self, keys: list[int]) -> list[int]:
        """Pages each CP rank gets back once all of `keys` are freed (shared pages that
        another sequence still references stay)."""
        release = PageRelease(self)
        for key in keys:
            release.add(key)
        return release.freed

    def decode_owners(self, keys: list[int]) -> list[int]:
        """The CP rank that stores each sequence's next token (the owner rule)."""
        if self.cp_size == 1:
            return [0] * len(keys)
        return [min(range(self.cp_size), key=lambda r: (self.seqs[k].counts[r], r))
                for k in keys]

    def decode_pages_needed(self, keys: list[int]) -> list[int]:
        """New pages each CP rank needs for one decode step of these sequences."""
        need = [0] * self.cp_size
        for key, owner in zip(keys, self.decode_owners(keys)):
            if self.seqs[key].counts[owner] % self.page_size == 0:
                need[owner] += 1
        return need

    def append_decode(self, keys: list[int]) -> list[int]:
        """Store one new token of each sequence on its owner -> this rank's write slot per
        row (the trash slot for rows another rank stores). All or nothing."""
        owners = self.decode_owners(keys)
        need = self.decode_pages_needed(keys)
        if not self.fits(need):
            r = max(range(self.cp_size), key=lambda r: need[r] - self.free_pages(r))
            raise CacheFullError(f"KV cache full: a decode step needs {need[r]} new pages on "
                                 f"CP rank {r}, {self.free_pages(r)} of {self.num_pages} free "
                                 f"(--max-total-tokens {self.capacity})")
        ps, me, slots = self.page_size, self.cp_rank, []
        for key, owner in zip(keys, owners):  # the per-step hot loop: no allocation checks
            seq = self.seqs[key]
            count = seq.counts[owner]
            seq.counts[owner] = count + 1
            if seq.owners is not None and self.cp_size > 1:
                seq.owners.append(owner)
            if count % ps == 0:
                seq.rank_pages[owner].append(self._alloc(owner))
            slots.append(seq.pages[count // ps] * ps + count % ps if owner == me
                         else self.trash_slot)
        return slots

    def free(self, key: int) -> None:
        """Drop sequence `key`; its pages no other sequence references are free again."""
        seq = self.seqs.pop(key)
        live = 0 if seq.cached else 1
        for r, pages in enumerate(seq.rank_pages):
            refs, lives = self._refs[r], self._live[r]
            for page in reversed(pages):
                refs[page] -= 1
                lives[page] -= live
                if refs[page] == 0:
                    self._free[r].append(page)
                    self.rank_pages[r] -= 1
                    if not live:
                        self.cached_pages[r] -= 1
                elif live and lives[page] == 0:
                    self.cached_pages[r] += 1

    def mark_cached(self, key: int) -> None:
        """Sequence `key` now only serves as a cached prefix (counted in `cached_pages`)."""
        seq = self.seqs[key]
        if seq.cached:
            return
        seq.cached = True
        for r, pages in enumerate(seq.rank_pages):
            lives = self._live[r]
            for page in pages:
                lives[page] -= 1
                if lives[page] == 0:
                    self.cached_pages[r] += 1

    # ---- what a step reads ----------------------------------------------------------------------
    def local_len(self, key: int) -> int:
        return self.seqs[key].counts[self.cp_rank]

    def block_table(self, keys: list[int], width: int | None = None) -> list[list[int]]:
        """This rank's pages of each sequence, padded with 0 to `width` (default: the most)."""
        rows = [self.seqs[k].pages for k in keys]
        width = max((len(p) for p in rows), default=0) if width is None else width
        if any(len(p) > width for p in rows):
            raise ValueError(f"a sequence holds more than {width} pages on CP rank "
                             f"{self.cp_rank}")
        return [p + [0] * (width - len(p)) for p in rows]

    def local_slots(self, key: int) -> torch.Tensor:
        """Slots of this rank's stored tokens of `key`, in order (int64, host)."""
        seq, ps = self.seqs[key], self.page_size
        n = seq.counts[self.cp_rank]
        pages = torch.tensor(seq.pages, dtype=torch.int64)
        return (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype,
             kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [n, Hkv, D] of the slots [n], in `dtype` (FP8 pools widened, times the
        layer's k_scale and v_scale: kv_scale [4], `ops.norm`; None: 1)."""
        k, v = self.k[layer], self.v[layer]
        ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        return (widen_kv(pool_rows(k.view(-1, *k.shape[2:]), slots), ks, dtype),
                widen_kv(pool_rows(v.view(-1, *v.shape[2:]), slots), vs, dtype))


class PageRelease:
    """What freeing more and more sequences gives back, counted as they are added (a step
    being planned adds its frees and evictions one by one)."""

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.freed = [0] * kv.cp_size  # pages each CP rank gets back
        self._drops: list[dict[int, int]] = [{} for _ in range(kv.cp_size)]

    def add(self, key: int) -> list[int]:
        """Count sequence `key` as freed -> pages it gives back on each CP rank."""
        more = [0] * self.kv.cp_size
        for r, pages in enumerate(self.kv.seqs[key].rank_pages):
            drops, refs = self._drops[r], self.kv._refs[r]
            for page in pages:
                d = drops.get(page, 0) + 1
                drops[page] = d
                if d == refs[page]:
                    more[r] += 1
            self.freed[r] += more[r]
        return more

