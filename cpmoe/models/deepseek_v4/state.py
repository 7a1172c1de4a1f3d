"""The static tensors of the DeepSeek-V4 decode cache (see deepseek_v4/cache.py) and the
metadata of one decode step.

Every tensor is allocated once, so a decode step only reads and writes at indices (no
per-sequence tensors, no concatenation): a CUDA graph can capture the step, and one step
serves every row at once. Sequences own a slot `s` (the last slot absorbs padded rows);
compressed entries live in pages of `ENTRY_PAGE` entries of one pool per layer.

Legend: S = sequence slots (+1 trash), W = sliding window, R = ring rows (2m with overlap,
else m), F2 = a compressor's projected row width (kv and gate), P = entry pages (+1 trash),
d = entry width, B = decode rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ENTRY_PAGE = 16  # compressed entries per page of a pool


@dataclass
class CompressorPool:
    """One compressor of one layer, every sequence: its ring of projected rows (the row of
    position p at p % R: the open window and, with overlap, the one before it) and this CP
    rank's pooled entries, page by page."""

    rows: torch.Tensor  # [S, R, F2]
    entries: torch.Tensor  # [P * ENTRY_PAGE, d]


@dataclass
class LayerCache:
    window: torch.Tensor  # [S, W, D]: KV row of position p at p % W
    comp: CompressorPool | None
    index: CompressorPool | None


@dataclass
class DecodeStep:
    """Where each row of one decode step reads and writes (device tensors, int64). Per
    compress rate m: `write` the entry slot its new entry goes to (the trash slot when the
    token closes no window or another CP rank owns the entry), `count` its local entries
    after the step, and `widths[m]` the page columns of the cache's page table the step
    reads (a Python int: fixed per captured graph; columns past a row's pages are masked
    by its count). Padded rows use the trash sequence slot, count 0."""

    seq_slot: torch.Tensor  # [B]
    write: dict[int, torch.Tensor]  # rate -> [B]
    count: dict[int, torch.Tensor]  # rate -> [B]
    widths: dict[int, int]  # rate -> page columns read

    def rows(self, n: int, widths: dict[int, int]) -> "DecodeStep":
        """The first n rows, reading `widths` page columns (views: a static buffer's slices
        stay where a captured graph reads them)."""
        return DecodeStep(self.seq_slot[:n], {m: w[:n] for m, w in self.write.items()},
                          {m: c[:n] for m, c in self.count.items()}, dict(widths))
