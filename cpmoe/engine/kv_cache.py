"""A preallocated, CP-sharded KV cache of one rank.

Each rank stores K/V only for the tokens it owns: after a CP prefill that is its CP chunk,
during decode the new token of a sequence goes to the CP rank holding the fewest tokens of
that sequence (ties: lowest rank), so shards stay balanced. Attention-TP shards heads as
usual. Slots are rows of one pool per layer; a sequence's rows need not be contiguous.

Legend: S = slots (capacity), Hkv = local KV heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class CacheFullError(RuntimeError):
    pass


@dataclass
class SeqKV:
    """What this rank holds of one sequence: slots and the positions stored in them."""

    slots: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n]
    length: int = 0  # tokens of the whole sequence so far, over all CP ranks
    cp_counts: list[int] = field(default_factory=list)  # tokens held by each CP rank


class KVCache:
    def __init__(self, num_layers: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        shape = (capacity, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low slots first
        self.seqs: dict[int, SeqKV] = {}

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def bytes_per_token(self) -> int:
        per_layer = self.k[0][0].numel() * self.k[0].element_size() * 2 if self.k else 0
        return per_layer * len(self.k)

    def nbytes_used(self) -> int:
        return self.used * self.bytes_per_token()

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise CacheFullError(f"KV cache full: need {n} more slots, {len(self._free)} of "
                                 f"{self.capacity} free")
        slots = [self._free.pop() for _ in range(n)]
        return torch.tensor(slots, dtype=torch.int64)

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self._free.extend(seq.slots.tolist())

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if slots.numel():
            self.k[layer][slots] = k.to(self.k[layer].dtype)
            self.v[layer][slots] = v.to(self.v[layer].dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][slots], self.v[layer][slots]


def busiest_rank_tokens(seq_counts: list[list[int]], new_tokens: int) -> int:
    """KV slots the busiest CP rank needs for prompts split as seq_counts[rank][seq] plus
    `new_tokens` generated per prompt (the last one is never fed back, so never stored),
    placed by the decode rule: fewest tokens of that sequence first, ties to the lower rank."""
    cp = len(seq_counts)
    totals = [0] * cp
    for s in range(len(seq_counts[0])):
        counts = [seq_counts[r][s] for r in range(cp)]
        for _ in range(max(0, new_tokens - 1)):
            owner = min(range(cp), key=lambda r: (counts[r], r))
            counts[owner] += 1
        for r in range(cp):
            totals[r] += counts[r]
    return max(totals)
