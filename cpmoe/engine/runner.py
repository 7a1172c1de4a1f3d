"""One rank's engine: builds and loads its model shard, runs CP prefill and decode steps.

Every decision that changes which collectives run (splits, padding, which CP rank stores a
new token) is computed from information all ranks share, so ranks never diverge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cpmoe.config import QwenMoeConfig
from cpmoe.cp.attention import query_runs
from cpmoe.cp.split import CPSplit
from cpmoe.engine.forward import ForwardBatch
from cpmoe.engine.kv_cache import CacheFullError, KVCache, SeqKV
from cpmoe.loader import fill_parameters, load_checkpoint
from cpmoe.models.random_weights import RandomCheckpoint
from cpmoe.models.registry import config_from_dict, load_model_config
from cpmoe.moe import placement
from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import LayoutError, ParallelLayout


def check_model_fit(layout: ParallelLayout, cfg: QwenMoeConfig) -> None:
    """All model-fit rules; run before spawning ranks."""
    check_layout = getattr(cfg, "check_layout", None)  # model-specific rules (DeepSeek-V4)
    if check_layout is not None:
        check_layout(layout)
    layout.check_model(num_experts=cfg.num_experts, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads,
                       moe_intermediate_size=cfg.moe_intermediate_size)
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_sparse_layer(i)]
    if dense and cfg.intermediate_size % layout.attn_tp_size:
        raise LayoutError(f"attention TP size {layout.attn_tp_size} must divide the model's "
                          f"intermediate_size {cfg.intermediate_size} (dense layers {dense})")


def memory_per_rank(config, model_cls: type, layout: ParallelLayout,
                    dtype: torch.dtype) -> list[dict[str, int | None]]:
    """Weight bytes and KV bytes per stored token of every rank's shard, from shards built
    on the meta device (no memory, no processes). KV is None for models that keep their own
    per-sequence caches (DeepSeek-V4)."""
    out = []
    for rank in range(layout.world_size):
        with torch.device("meta"):
            model = model_cls(config, ProcessGroups.offline(layout, rank), dtype)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        kv = None
        if getattr(model, "make_kv_cache", None) is None:
            attn = model.model.layers[0].self_attn
            kv = (2 * len(model.model.layers) * attn.num_kv_heads * attn.head_dim
                  * torch.empty((), dtype=dtype).element_size())
        out.append({"rank": rank, "weight_bytes": weights, "kv_bytes_per_token": kv})
    return out


@dataclass
class StepTimes:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0


class ModelRunner:
    def __init__(self, model_dir: Path, groups: ProcessGroups, dtype: torch.dtype,
                 show_progress: bool = True) -> None:
        config, model_cls = load_model_config(model_dir)
        self._build(config, model_cls, groups, dtype)
        self.load_stats = load_checkpoint(self.model, model_dir,
                                          show_progress=show_progress and groups.rank == 0,
                                          tied_embeddings=self.config.tie_word_embeddings)

    @classmethod
    def from_config(cls, config_json: dict, groups: ProcessGroups, dtype: torch.dtype,
                    seed: int = 0) -> "ModelRunner":
        """A runner with seeded random weights at the shape of an HF config.json's contents;
        the weights are the same on every layout (see models/random_weights.py)."""
        config, model_cls = config_from_dict(config_json)
        self = cls.__new__(cls)
        self._build(config, model_cls, groups, dtype)
        source = RandomCheckpoint.of(model_cls, config, seed, groups.device, dtype)
        self.load_stats = fill_parameters(self.model, [(Path("<random weights>"), source)],
                                          "<random weights>", show_progress=False,
                                          tied_embeddings=config.tie_word_embeddings)
        return self

    def _build(self, config, model_cls: type, groups: ProcessGroups, dtype: torch.dtype) -> None:
        self.groups = groups
        self.layout = groups.layout
        self.device = groups.device
        self.dtype = dtype
        self.config = config
        check_model_fit(self.layout, config)
        with torch.device(self.device):
            self.model = model_cls(config, groups, dtype)
        self.model.eval()
        self.kv: KVCache | None = None
        self.times = StepTimes()

    # ---- memory ----------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def allocate_kv(self, capacity: int) -> KVCache:
        make_cache = getattr(self.model, "make_kv_cache", None)
        if make_cache is not None:  # per-sequence model state, not K/V slots (DeepSeek-V4)
            self.kv = make_cache(capacity)
            return self.kv
        attn = self.model.model.layers[0].self_attn
        self.kv = KVCache(len(self.model.model.layers), capacity, attn.num_kv_heads,
                          attn.head_dim, self.dtype, self.device)
        return self.kv

    def check_fits(self, slots: int) -> None:
        """Refuse work whose KV does not fit this rank's cache, before any of it runs."""
        assert self.kv is not None
        free = self.kv.capacity - self.kv.used
        if slots > free:
            raise CacheFullError(f"request needs {slots} KV slots on the busiest CP rank, "
                                 f"{free} of {self.kv.capacity} free (--max-total-tokens)")

    def agree(self, tokens: list[int]) -> list[int]:
        """Rank 0's choice of tokens, on every rank."""
        t = comm.broadcast(self._ids(tokens), self.groups.world)
        return t.tolist()

    def gather_from_ranks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """A small same-shaped tensor from every rank (for reports), in rank order."""
        return list(comm.all_gather(x[None], self.groups.world).cpu())

    # ---- expert placement ------------------------------------------------------------------
    def record_expert_load(self) -> None:
        """Count routed slots per expert from now on (see moe/placement.py)."""
        placement.record(self.model)

    def rebalance_experts(self) -> placement.RebalanceReport:
        """Re-place the experts over the EP ranks by the load recorded since
        `record_expert_load()` and move their weights; the outputs stay the same."""
        return placement.rebalance(self.model, self.groups)

    # ---- forward steps ---------------------------------------------------------------------
    def _ids(self, values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def prefill(self, seqs: list[list[int]], seq_keys: list[int] | None = None,
                last_only: bool = False) -> torch.Tensor:
        """CP prefill of new sequences. Returns logits (float32) of every token in flat
        order ([sum L, V]) or, with last_only, of each sequence's last token ([B, V]).
        With a KV cache allocated, each rank keeps the K/V of its own chunk under seq_keys."""
        t0 = time.perf_counter()
        lens = [len(s) for s in seqs]
        cp = self.groups.attn_cp
        split = CPSplit.build(lens, cp.size, self.layout.cp_strategy)
        flat = self._ids([t for s in seqs for t in s])
        positions, seq_ids = split.local_positions(cp.rank), split.local_seq_ids(cp.rank)
        batch = ForwardBatch(is_decode=False, input_ids=split.scatter(flat, cp.rank),
                             positions=positions.to(self.device),
                             seq_ids=seq_ids.to(self.device), split=split,
                             q_runs=query_runs(positions, seq_ids))
        if self.kv is not None:
            self._reserve_prefill(batch, split, seq_keys or list(range(len(seqs))))
        hidden = self.model.hidden_states(batch)
        if last_only:
            hidden = hidden[torch.tensor(split.cu_seqlens[1:], device=self.device) - 1]
        logits = self.model.logits(hidden).float()
        self.times.prefill_s += time.perf_counter() - t0
        return logits

    def _reserve_prefill(self, batch: ForwardBatch, split: CPSplit, keys: list[int]) -> None:
        kv, cp = self.kv, self.groups.attn_cp
        assert kv is not None
        need = batch.num_tokens
        if need > kv.capacity - kv.used:
            raise CacheFullError(f"KV cache full: this prefill needs {need} slots on CP rank "
                                 f"{cp.rank}, {kv.capacity - kv.used} of {kv.capacity} free")
        slots = kv.alloc(need).to(self.device)
        batch.kv = kv
        batch.seq_keys = keys
        batch.write_rows = torch.arange(need, device=self.device)
        batch.write_slots = slots
        for s, key in enumerate(keys):
            mine = batch.seq_ids == s
            kv.seqs[key] = SeqKV(slots=slots[mine], positions=batch.positions[mine],
                                 length=split.seq_lens[s],
                                 cp_counts=[split.seq_counts[r][s] for r in range(cp.size)])

    @torch.no_grad()
    def decode(self, keys: list[int], tokens: list[int]) -> torch.Tensor:
        """One new token per sequence -> logits [B, V] (float32). The new K/V goes to the
        CP rank holding the fewest tokens of the sequence (ties: the lowest rank)."""
        t0 = time.perf_counter()
        kv, cp = self.kv, self.groups.attn_cp
        assert kv is not None, "decode needs a KV cache (allocate_kv)"
        positions, write_rows, owners = [], [], []
        for i, key in enumerate(keys):
            seq = kv.seqs[key]
            owner = min(range(cp.size), key=lambda r: (seq.cp_counts[r], r))
            positions.append(seq.length)
            owners.append(owner)
            if owner == cp.rank:
                write_rows.append(i)
        slots = kv.alloc(len(write_rows)).to(self.device)
        for row, slot in zip(write_rows, slots):
            seq = kv.seqs[keys[row]]
            seq.slots = torch.cat([seq.slots, slot[None]])
            seq.positions = torch.cat([seq.positions, self._ids([positions[row]])])
        for i, key in enumerate(keys):
            seq = kv.seqs[key]
            seq.length += 1
            seq.cp_counts[owners[i]] += 1
        batch = ForwardBatch(is_decode=True, input_ids=self._ids(tokens),
                             positions=self._ids(positions),
                             seq_ids=torch.arange(len(keys), device=self.device), kv=kv,
                             write_rows=self._ids(write_rows), write_slots=slots, seq_keys=keys,
                             ctx=[(kv.seqs[k].slots, kv.seqs[k].positions) for k in keys])
        logits = self.model.logits(self.model.hidden_states(batch)).float()
        self.times.decode_s += time.perf_counter() - t0
        self.times.decode_steps += 1
        return logits
