"""The DeepSeek-V4 decode cache of one CP rank and its size rule.

Per sequence key and layer one `SeqState`: the sliding window's last W-1 KV rows and the
still-open compressor rows (replicated on every CP rank, bounded), and this rank's share of
the compressed KV entries and indexer keys (entry c on CP rank c % cp_size). Token
accounting (capacity, per-sequence lengths) is the runner's `PagedKVCache` with one-token
pages and no K/V pools, kept the same on every rank (`cp_size` 1 there: the runner treats
the cache as the model's own and every rank sees every decode row).

`sequence_bytes` is the exact size rule (tests compare it with `nbytes_used`); `plan` prints
`cache_summary`.
"""

from __future__ import annotations

import torch

from cpmoe.engine.kv_cache import PagedKVCache
from cpmoe.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from cpmoe.models.deepseek_v4_state import SeqState


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class V4Cache(PagedKVCache):
    """Token accounting plus, per sequence key, one `SeqState` per layer holding this CP
    rank's share (see the module docstring)."""

    def __init__(self, cfg: DeepseekV4Config, capacity: int, dtype: torch.dtype,
                 device: torch.device, shard: tuple[int, int] = (0, 1)) -> None:
        super().__init__(0, capacity, 1, 1, 1, dtype, device)
        self.cfg, self.dtype = cfg, dtype
        self.shard = shard  # (cp_rank, cp_size) of the compressed entries held here
        self.states: dict[int, list[SeqState | None]] = {}

    def state(self, key: int, layer: int) -> SeqState:
        st = self.states[key][layer]
        assert st is not None, f"sequence {key} has no V4 state at layer {layer}"
        return st

    def put(self, key: int, layer: int, st: SeqState) -> None:
        self.states.setdefault(key, [None] * self.cfg.num_hidden_layers)[layer] = st

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self.states.pop(seq_id, None)

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
        """Bytes of every tensor this rank holds for its sequences."""
        total = 0
        for layers in self.states.values():
            for st in filter(None, layers):
                parts = [st.window] + [p for s in (st.comp, st.index) if s is not None
                                       for p in (s.entries, s.rows)]
                total += sum(p.numel() * p.element_size() for p in parts)
        return total
