"""How a batch of sequences is split over context-parallel (CP) ranks, and back.

Each sequence of the batch is split separately over ``cp_size`` ranks:

* ``zigzag``: the sequence (length L) is cut into 2*cp contiguous blocks; the
  first ``L % (2cp)`` blocks hold ``L // (2cp) + 1`` tokens, the rest ``L // (2cp)``
  (blocks may be empty when L < 2cp). Rank r keeps blocks r and 2cp-1-r, which
  pairs a cheap early block with an expensive late one and so balances causal
  attention work.
* ``interleave``: token i goes to rank ``i % cp``.

A sequence may be split with a rotation ``rot``: the token the rule gives rank r goes to
rank ``(r + rot) % cp`` (chunked prefill rotates each chunk's split towards the ranks
that hold fewer of the sequence's tokens).

Invariants (what the rest of the engine relies on):

1. Every token of every sequence lives on exactly one rank.
2. Local order on a rank: sequence by sequence in batch order, and within a
   sequence by increasing position. For zigzag that is block r then block
   2cp-1-r, because block r precedes block 2cp-1-r in the sequence. Hence a
   rank's local tokens are exactly the flat tokens it owns, in flat order.
3. A rank may hold zero tokens of a sequence, or zero tokens overall.
4. After an all-gather each rank's rows are zero-padded to ``max_count``
   (>= 1, so a gather never has zero rows); rank r's rows occupy gathered rows
   ``[r*max_count, r*max_count + counts[r])``.
5. ``cp_size == 1`` is the identity everywhere.

Legend:
  B          number of sequences in the batch
  L_b        length of sequence b (>= 1); position = index within its own sequence
  flat       the batch concatenated in order; ``cu_seqlens`` are its offsets
  total      sum of L_b = number of flat tokens
  local      the tokens one rank keeps, in the order of invariant 2
  gathered   ``cp_size * max_count`` rows: every rank's padded local rows, by rank
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cpmoe.parallel.layout import CP_STRATEGIES as STRATEGIES  # the names live with --cp-strategy


def _as_int(v: object) -> int | None:
    # operator.index accepts numpy/torch integer scalars but not floats or bools-as-lengths
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check(seq_lens: Sequence[int], cp_size: int, strategy: str) -> tuple[tuple[int, ...], int]:
    """Validate inputs; return them as plain Python ints."""
    cp = _as_int(cp_size)
    if cp is None or cp < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if strategy not in STRATEGIES:
        allowed = ", ".join(STRATEGIES)
        raise ValueError(f"unknown CP split strategy {strategy!r}; allowed: {allowed}")
    if len(seq_lens) == 0:
        raise ValueError("cannot split an empty batch: seq_lens has no sequences")
    lens = tuple(_as_int(n) for n in seq_lens)
    for b, n in enumerate(lens):
        if n is None or n < 1:
            raise ValueError(
                f"sequence {b} has length {seq_lens[b]!r}; every length must be an int >= 1"
            )
    return lens, cp  # type: ignore[return-value]


def _rank_of(pos: torch.Tensor, length: torch.Tensor, cp_size: int, strategy: str) -> torch.Tensor:
    """Owning rank of each token, from its position and its sequence's length (vectorised)."""
    if strategy == "interleave":
        return pos % cp_size
    two = 2 * cp_size
    q, rem = length // two, length % two
    big = rem * (q + 1)  # the first `rem` blocks (one token longer) span positions [0, big)
    # clamp: when q == 0 every position is < big, so the second branch is never taken
    block = torch.where(pos < big, pos // (q + 1), rem + (pos - big) // q.clamp(min=1))
    return torch.where(block < cp_size, block, two - 1 - block)


def split_positions(length: int, cp_size: int, strategy: str) -> list[torch.Tensor]:
    """Per CP rank, the sorted int64 positions of one sequence that the rank keeps."""
    (length,), cp_size = _check([length], cp_size, strategy)
    pos = torch.arange(length, dtype=torch.int64)
    rank = _rank_of(pos, torch.full_like(pos, length), cp_size, strategy)
    return [pos[rank == r] for r in range(cp_size)]


def rank_counts(length: int, cp_size: int, strategy: str, rotation: int = 0) -> list[int]:
    """Tokens of one sequence of `length` that each CP rank keeps, in O(cp) (the counts
    `CPSplit.build` produces for a sequence split with this rotation, without building it)."""
    if strategy == "interleave":
        base = [length // cp_size + (1 if r < length % cp_size else 0) for r in range(cp_size)]
    else:
        q, rem = divmod(length, 2 * cp_size)
        block = [q + (1 if b < rem else 0) for b in range(2 * cp_size)]
        base = [block[r] + block[2 * cp_size - 1 - r] for r in range(cp_size)]
    return [base[(r - rotation) % cp_size] for r in range(cp_size)]


def balancing_rotation(stored: Sequence[int], length: int, strategy: str) -> int:
    """The rotation for `length` more tokens of a sequence whose ranks already store
    `stored` tokens: the one whose rank totals, largest first, are smallest in lexicographic
    order (the fullest rank lowest, then the next...; ties: the smallest rotation, so a new
    sequence gets the plain split). Chunk after chunk, the larger shares
    of a split go to the emptier ranks, so a chunked prompt ends as balanced as one piece."""
    cp = len(stored)
    if cp == 1 or not any(stored):
        return 0
    return min(range(cp), key=lambda rot: (sorted(
        (a + b for a, b in zip(stored, rank_counts(length, cp, strategy, rot))), reverse=True),
        rot))


@dataclass(frozen=True)
class CPSplit:
    """The split of one batch over CP ranks; build it with :meth:`CPSplit.build`.

    Index tensors are computed once in ``build`` (CPU, int64) and stored in
    private fields excluded from ``repr``/``==``: tensors have no boolean
    equality, and two splits of the same inputs are equal anyway.
    """

    cp_size: int
    strategy: str
    seq_lens: tuple[int, ...]
    counts: tuple[int, ...]  # tokens per rank
    seq_counts: tuple[tuple[int, ...], ...]  # [rank][seq] tokens of seq on rank
    max_count: int  # max(counts), at least 1
    cu_seqlens: tuple[int, ...]  # len B+1, flat offsets
    rotations: tuple[int, ...]  # per sequence, its split's rank rotation
    # flat indices grouped by rank, each group in local order (a stable sort by rank)
    _order: torch.Tensor = field(repr=False, compare=False)
    _rank_start: tuple[int, ...] = field(repr=False, compare=False)  # rank r's group in _order
    _positions: torch.Tensor = field(repr=False, compare=False)  # [total] position of flat token
    _token_to_seq: torch.Tensor = field(repr=False, compare=False)  # [total] flat token's seq
    _gathered_to_flat: torch.Tensor = field(repr=False, compare=False)  # [total]
    # the same index tensors moved to accelerators, so a GPU forward copies them only once
    _dev_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def build(seq_lens: Sequence[int], cp_size: int, strategy: str,
              rotations: Sequence[int] | None = None) -> "CPSplit":
        seq_lens, cp_size = _check(tuple(seq_lens), cp_size, strategy)
        rots = tuple(int(r) % cp_size for r in rotations) if rotations else (0,) * len(seq_lens)
        if len(rots) != len(seq_lens):
            raise ValueError(f"{len(rots)} rotations for {len(seq_lens)} sequences")
        n_seq = len(seq_lens)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        cu = torch.zeros(n_seq + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        total = int(cu[-1])
        token_to_seq = torch.repeat_interleave(torch.arange(n_seq, dtype=torch.int64), lens)
        positions = torch.arange(total, dtype=torch.int64) - cu[:-1][token_to_seq]
        rank = _rank_of(positions, lens[token_to_seq], cp_size, strategy)
        if any(rots):
            rank = (rank + torch.tensor(rots, dtype=torch.int64)[token_to_seq]) % cp_size
        # Stable sort keeps flat order inside each rank, which is exactly the local
        # order (invariant 2), so one sort gives every rank's local->flat map.
        order = torch.sort(rank, stable=True).indices
        counts_t = torch.bincount(rank, minlength=cp_size)
        starts_t = torch.cumsum(counts_t, 0) - counts_t
        counts = tuple(int(c) for c in counts_t.tolist())
        max_count = max(1, max(counts))
        # Row of each flat token in the gather: its rank's slab + its slot in local order.
        slot = torch.empty(total, dtype=torch.int64)
        slot[order] = torch.arange(total, dtype=torch.int64)
        gathered_to_flat = rank * max_count + (slot - starts_t[rank])
        seq_counts_t = torch.bincount(rank * n_seq + token_to_seq, minlength=cp_size * n_seq)
        return CPSplit(
            cp_size=cp_size,
            strategy=strategy,
            seq_lens=seq_lens,
            counts=counts,
            seq_counts=tuple(tuple(row) for row in seq_counts_t.view(cp_size, n_seq).tolist()),
            max_count=max_count,
            cu_seqlens=tuple(cu.tolist()),
            rotations=rots,
            _order=order,
            _rank_start=tuple(starts_t.tolist()),
            _positions=positions,
            _token_to_seq=token_to_seq,
            _gathered_to_flat=gathered_to_flat,
        )

    @property
    def total(self) -> int:
        """Number of flat tokens (sum of sequence lengths)."""
        return self.cu_seqlens[-1]

    def _local(self, cp_rank: int) -> torch.Tensor:
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {self.cp_size}")
        start = self._rank_start[cp_rank]
        return self._order[start : start + self.counts[cp_rank]]

    def _on(self, name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return t
        key = (name, device)
        if key not in self._dev_cache:
            self._dev_cache[key] = t.to(device)
        return self._dev_cache[key]

    # Public accessors return copies: the cached tensors are shared by every
    # caller of this split, and an in-place edit by one must not corrupt the rest.
    def local_flat_index(self, cp_rank: int) -> torch.Tensor:
        """int64 [counts[r]]: flat index of each local token, in local order."""
        return self._local(cp_rank).clone()

    def local_positions(self, cp_rank: int) -> torch.Tensor:
        """int64 [counts[r]]: position within its sequence of each local token."""
        return self._positions[self._local(cp_rank)]

    def local_token_to_seq(self, cp_rank: int) -> torch.Tensor:
        """int64 [counts[r]]: batch index of the sequence of each local token."""
        return self._token_to_seq[self._local(cp_rank)]

    def gathered_to_flat(self) -> torch.Tensor:
        """int64 [total]: for each flat token, its row in the padded gather [cp*max_count]."""
        return self._gathered_to_flat.clone()

    def scatter(self, x_flat: torch.Tensor, cp_rank: int) -> torch.Tensor:
        """Rows of ``x_flat`` [total, ...] that ``cp_rank`` keeps, in local order."""
        if x_flat.shape[0] != self.total:
            raise ValueError(f"x_flat has {x_flat.shape[0]} rows, expected total={self.total}")
        idx = self._local(cp_rank)
        return x_flat.index_select(0, self._on(f"local{cp_rank}", idx, x_flat.device))

    def unpermute(self, gathered: torch.Tensor) -> torch.Tensor:
        """[cp*max_count, ...] padded gather -> [total, ...] in flat order (padding dropped)."""
        rows = self.cp_size * self.max_count
        if gathered.shape[0] != rows:
            raise ValueError(
                f"gathered has {gathered.shape[0]} rows, expected cp_size*max_count={rows}"
            )
        idx = self._on("g2f", self._gathered_to_flat, gathered.device)
        return gathered.index_select(0, idx)

    def pad_local(self, x_local: torch.Tensor) -> torch.Tensor:
        """[count_r, ...] -> [max_count, ...], zero rows appended (equal-size all-gather input)."""
        n = x_local.shape[0]
        if n > self.max_count:
            raise ValueError(f"x_local has {n} rows, more than max_count={self.max_count}")
        out = x_local.new_zeros((self.max_count, *x_local.shape[1:]))
        out[:n] = x_local
        return out
