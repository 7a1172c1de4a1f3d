"""Per-forward metadata of one rank, passed as an argument through the model (never global).

Extend (prefill, or one chunk of a long prompt): this CP rank's share of the step's new
tokens of every sequence (`split` says which), in local order (sequence by sequence,
increasing position). Every rank of an attention-TP group holds the same rows. A sequence
may already hold `start` tokens in the KV cache (an earlier chunk): its new tokens attend
those through `prefix` (the part of the prefix this rank stores) and each other causally.

Decode: one new token per sequence, the same rows on every rank. Each row's K/V goes to
`write_slots` (the trash slot on ranks that do not store it); attention reads every row's
pages on this rank through `block_table` / `kv_lens` and merges with the other CP ranks.

Two names for a sequence: `token_to_seq` maps each token to its sequence's index in this
step's batch (0..B-1, what attention groups rows by); `cache_keys` gives each sequence its key
in the KV cache (the scheduler's request key, stable across steps; a model with its own caches
looks the sequence up by it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.cp.attention import PackedPrefix, PackedRuns
from cpmoe.cp.split import CPSplit


@dataclass
class ForwardBatch:
    is_decode: bool
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T] absolute positions (RoPE)
    token_to_seq: torch.Tensor  # int64 [T]: each token's sequence, as its index in this batch
    split: CPSplit | None = None  # extend: the split of the step's new tokens
    rel_positions: torch.Tensor | None = None  # extend: position within the step's tokens
    q_runs: list[tuple[int, int, int, int]] | None = None  # extend: cp.attention.query_runs
    packed_runs: PackedRuns | None = None  # extend on CUDA: q_runs for varlen attention
    kv: object | None = None  # the KV cache (PagedKVCache, or a model's own cache)
    write_slots: torch.Tensor | None = None  # int64: extend [T] / decode [B] cache slots
    block_table: torch.Tensor | None = None  # decode: int32 [B, W] this rank's pages
    kv_lens: torch.Tensor | None = None  # decode: int32 [B] tokens this rank stores
    prefix: PackedPrefix | None = None  # extend: sequences with cached tokens on this rank
    cache_keys: list[int] | None = None  # [B]: each sequence's KV-cache key (request key)
    fp8_attention: bool = False  # extend: attention in FP8 (fp8_e4m3 pools and `fp8_worth`)
    seq_ends: list[int] | None = None  # extend: tokens each sequence holds once its prompt
    # is in (a chunk's whole prompt), for models whose ranking spans the whole prompt

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
