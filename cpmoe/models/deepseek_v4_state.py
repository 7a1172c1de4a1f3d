"""What the DeepSeek-V4 decode cache holds per sequence and layer (see deepseek_v4_cache.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompressorState:
    """What a compressor knows of one sequence: `total` entries pooled so far, of which this
    CP rank keeps `entries` [C_local, d] (entry c lives on CP rank c % cp_size, in order; one
    rank keeps them all), and the projected rows [r, 2F] it still needs, from the start of
    window total-1 (overlap) or total onwards (replicated: at most 2m rows)."""

    entries: torch.Tensor
    rows: torch.Tensor
    total: int = 0


@dataclass
class SeqState:
    """One sequence at one layer: KV rows of the last W-1 positions and compressor states."""

    window: torch.Tensor  # [<= W-1, D]
    comp: CompressorState | None
    index: CompressorState | None
