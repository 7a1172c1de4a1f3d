"""Per-forward metadata of one rank, passed as an argument through the model (never global).

Prefill: this CP rank's chunk of every sequence of the batch (`split` says which tokens),
in local order (sequence by sequence, increasing position). Every rank of an attention-TP
group holds the same rows.

Decode: one new token per sequence, the same rows on every rank. `write_rows` are the rows
whose K/V this rank stores; `ctx` lists, per sequence, the slots and positions of the KV
this rank holds after the write (its shard of the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.cp.split import CPSplit
from cpmoe.engine.kv_cache import KVCache


@dataclass
class ForwardBatch:
    is_decode: bool
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    seq_ids: torch.Tensor  # int64 [T], index of the sequence in the batch
    split: CPSplit | None = None  # prefill
    kv: KVCache | None = None
    write_rows: torch.Tensor | None = None  # int64 [W] rows of this batch stored here
    write_slots: torch.Tensor | None = None  # int64 [W] their cache slots
    ctx: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # decode: (slots, positions)
    q_runs: list[tuple[int, int, int, int]] | None = None  # prefill: cp.attention.query_runs
    seq_keys: list[int] | None = None  # cache key of each sequence (models with their own cache)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
