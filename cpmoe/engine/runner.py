"""One rank's engine: builds and loads its model shard, runs extend (prefill, chunked prefill)
and decode steps over the paged, CP-sharded KV cache.

Every decision that changes which collectives run (splits, padding, which CP rank stores a
new token) is computed from information all ranks share, so ranks never diverge.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cpmoe.config import parse_quantization, read_config_json
from cpmoe.cp.attention import PackedPrefix, PackedRuns, fp8_worth, query_runs
from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.cp.kv_cache import CacheFullError, PagedKVCache, kv_cache_dtype
from cpmoe.cp.kv_capacity import DEFAULT_PAGE_SIZE, pages_for
from cpmoe.cp.split import CPSplit
from cpmoe.engine.sizing import (fp8_attention_applies, fp8_attention_refusal,
                                 kv_bytes_per_token, kv_cache_refusal, kv_scale_note,
                                 with_quantization)
from cpmoe.loader import fill_parameters, load_checkpoint
from cpmoe.models.random_weights import RandomCheckpoint
from cpmoe.models.registry import check_model_fit, config_from_dict, load_model_config
from cpmoe.moe import placement
from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups


LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class Segment:
    """New tokens of one sequence in an extend step; `start` tokens are cached already."""

    key: int
    ids: list[int]
    start: int = 0
    end: int = 0  # the tokens its sequence will hold once its prompt is in (0: this one's end)


@dataclass
class StepTimes:
    """Host seconds inside `extend` / `decode` calls: the time to build and launch their work.
    Neither call waits for the device (no stream sync), so on CUDA the device may still be
    running it when they return; the wait for tokens falls in the step loop."""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0


class ModelRunner:
    def __init__(self, model_dir: Path, groups: ProcessGroups, dtype: torch.dtype,
                 show_progress: bool = True, load_format: str = "auto", seed: int = 0,
                 quantization: str | None = None, fp8_compute: bool = True) -> None:
        """quantization "fp8": quantize 16-bit weights to FP8 blocks at load (a no-op for
        an FP8 checkpoint); FP8 checkpoints load as FP8 without it. fp8_compute False:
        FP8 weights are dequantized at load on CUDA too (the reference FP8 is checked
        against)."""
        self.fp8_compute = fp8_compute
        if load_format == "dummy":  # random weights at the checkpoint's shape (SGLang's name)
            self._init_random(read_config_json(model_dir), groups, dtype, seed, quantization)
            return
        config, model_cls = load_model_config(model_dir)
        config = with_quantization(config, quantization)
        self._build(config, model_cls, groups, dtype)
        quant = config.quantization
        if quant is not None and not quant.online and self._keep_fp8():
            from cpmoe.loader import quantized_weight_names
            from cpmoe.quant.modules import prepare_fp8
            prepare_fp8(self.model, quantized_weight_names(model_dir), quant)
        self.load_stats = load_checkpoint(self.model, model_dir,
                                          show_progress=show_progress and groups.rank == 0,
                                          tied_embeddings=self.config.tie_word_embeddings,
                                          quantization=quant)
        self._finish_load()

    def _finish_load(self) -> None:
        """`--quantization fp8` of 16-bit weights; on the GPU, fused weights (fewer GEMMs)."""
        quant = self.config.quantization
        if quant is not None and quant.online:
            from cpmoe.quant.modules import quantize_loaded
            quantize_loaded(self.model, quant, keep_fp8=self._keep_fp8())
        if self.device.type == "cuda":
            self.model.fuse_weights()

    def _keep_fp8(self) -> bool:
        """FP8 weights stay FP8 (FP8 GEMMs) on CUDA; elsewhere they are dequantized."""
        return self.device.type == "cuda" and self.fp8_compute

    @classmethod
    def from_config(cls, config_json: dict, groups: ProcessGroups, dtype: torch.dtype,
                    seed: int = 0, quantization: str | None = None) -> "ModelRunner":
        """A runner with seeded random weights at the shape of an HF config.json's contents;
        the weights are the same on every layout (see models/random_weights.py)."""
        self = cls.__new__(cls)
        self.fp8_compute = True
        self._init_random(config_json, groups, dtype, seed, quantization)
        return self

    def _init_random(self, config_json: dict, groups: ProcessGroups, dtype: torch.dtype,
                     seed: int, quantization: str | None = None) -> None:
        config, model_cls = config_from_dict(
            {k: v for k, v in config_json.items() if k != "quantization_config"})
        # random weights are 16-bit: an FP8 checkpoint's shape is quantized online (a
        # K/V-cache-only quantization_config quantizes no weight)
        fp8 = quantization or ("fp8" if parse_quantization(config_json) is not None else None)
        config = with_quantization(config, fp8)
        self._build(config, model_cls, groups, dtype)
        source = RandomCheckpoint.of(model_cls, config, seed, groups.device, dtype)
        self.load_stats = fill_parameters(self.model, [(Path("<random weights>"), source)],
                                          "<random weights>", show_progress=False,
                                          tied_embeddings=config.tie_word_embeddings)
        self._finish_load()

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
        self.kv = None
        self.fp8_attention = False  # prefill attention in FP8 (`use_kv_cache_dtype`)
        self.graphs = None  # engine.cuda_graph.DecodeGraphs once captured
        # the last overlapped step's greedy tokens: what decode placeholders -(i + 1) name
        self.fed_tokens: torch.Tensor | None = None
        self.times = StepTimes()

    # ---- memory ----------------------------------------------------------------------------
    @property
    def own_cache(self) -> bool:
        """The model keeps its own per-sequence state instead of K/V pages (DeepSeek-V4)."""
        return self.model.own_cache

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_bytes_per_token(self, kv_dtype: str = "auto") -> int:
        """K/V bytes of one stored token in pools of --kv-cache-dtype `kv_dtype`."""
        return kv_bytes_per_token(self.model, self.dtype, kv_dtype)

    def allocate_kv(self, max_tokens: int, page_size: int = DEFAULT_PAGE_SIZE,
                    kv_dtype: str = "auto", max_seqs: int | None = None):
        """A cache of `max_tokens` token slots per rank (rounded up to whole pages), its pools
        of --kv-cache-dtype `kv_dtype`; a model's own cache has `max_seqs` sequence slots."""
        self.use_kv_cache_dtype(kv_dtype)
        if self.own_cache:  # per-sequence model state, not K/V pages (DeepSeek-V4)
            self.kv = self.model.make_kv_cache(max_tokens, max_seqs)
            return self.kv
        attn = self.model.model.layers[0].self_attn
        note = kv_scale_note(kv_dtype, self.load_stats.get("kv_scales", 0))
        if note and self.groups.rank == 0:
            print(f"cpmoe: {note}", file=sys.stderr, flush=True)
        cp = self.groups.attn_cp
        self.kv = PagedKVCache(len(self.model.model.layers), pages_for(max_tokens, page_size),
                               page_size, attn.num_kv_heads, attn.head_dim,
                               kv_cache_dtype(kv_dtype, self.dtype), self.device, cp.size,
                               cp.rank, self.layout.cp_strategy)
        return self.kv

    def use_kv_cache_dtype(self, kv_dtype: str) -> None:
        """Check --kv-cache-dtype `kv_dtype` against this model and device (ValueError, one
        line) and take its attention dtype: FP8 prefill attention for e4m3 pools on CUDA
        (`fp8_attention_applies`; without a cache too, as `cpmoe bench` runs)."""
        refusal = (kv_cache_refusal(kv_dtype, self.model)
                   or fp8_attention_refusal(kv_dtype, self.device, self.dtype))
        if refusal:
            raise ValueError(refusal)
        self.fp8_attention = fp8_attention_applies(kv_dtype, self.device, self.dtype)

    def kv_tokens_for_memory(self, mem_fraction: float, kv_dtype: str = "auto",
                             max_seqs: int = 256) -> int:
        """KV token slots per rank that fit `mem_fraction` of the GPU's memory next to what is
        in use now (weights), agreed over the ranks (SGLang's --mem-fraction-static: what the
        driver has free, less the 1 - mem_fraction kept for activations and graphs), in
        pools of --kv-cache-dtype `kv_dtype` (a model's own cache: of max_seqs slots). In use
        counts the segments the caching allocator cannot give back, not only the bytes
        allocated: an FP8 load frees its 16-bit weights between the FP8 ones it keeps, and
        on an 80 GB card 13.9 GiB stayed cached in such pieces, so pools sized from the
        allocated bytes did not fit (an FP8 server failed at its pools at 284afcb)."""
        torch.cuda.empty_cache()  # whole free segments back to the driver first
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(free - total * (1.0 - mem_fraction))
        fit = (self.model.cache_tokens_for_bytes(budget, max_seqs) if self.own_cache
               else budget // self.kv_bytes_per_token(kv_dtype))
        mine = torch.tensor([max(0, fit)], dtype=torch.int64, device=self.device)
        return int(min(self.gather_from_ranks(mine)))

    def can_capture_graphs(self) -> bool:
        """Decode graphs need CUDA, a model whose decode never syncs with the host (a model
        with its own cache says so and brings its own graphs: `can_capture_decode`,
        `decode_graphs`), and no host-side count exchange in the MoE dispatch. float32 on
        CUDA (the reference dtype) runs eagerly: its experts take the loop path, which reads
        counts on the host."""
        return (self.device.type == "cuda" and self.model.can_capture_decode()
                and self.dtype in (torch.bfloat16, torch.float16)
                and self.layout.moe_a2a_backend != "alltoall")

    def capture_decode_graphs(self, max_bs: int, max_context: int | None = None) -> int:
        """Capture the decode forward for batches up to max_bs -> graph memory in bytes."""
        from cpmoe.engine.cuda_graph import DecodeGraphs
        assert self.kv is not None and self.can_capture_graphs()
        context = max_context or self.config.max_position_embeddings
        if self.own_cache:  # DeepSeek-V4: the model's graphs over its own cache
            self.graphs = self.model.decode_graphs(self, max_bs, context or self.kv.capacity)
            return self.graphs.memory_bytes
        max_pages = self.kv.num_pages
        if context:
            max_pages = min(max_pages, pages_for(context, self.kv.page_size) + 1)
        self.graphs = DecodeGraphs(self, max_bs, max_pages)
        return self.graphs.memory_bytes

    def share_tokens(self, tokens: torch.Tensor | None, n: int) -> torch.Tensor:
        """Rank 0's n tokens (int64, on the device) on every rank, without a host sync; they
        feed the next decode step's placeholders (`feed`)."""
        if self.groups.world.size > 1:
            if tokens is None:
                tokens = torch.empty(n, dtype=torch.int64, device=self.device)
            comm.broadcast(tokens, self.groups.world)
        assert tokens is not None and tokens.numel() == n
        self.fed_tokens = tokens
        return tokens

    def feed(self, ids: torch.Tensor, tokens: list[int]) -> None:
        """In place: the placeholders among a decode step's input ids (`tokens`, as on the
        host; -(i + 1) is row i of `share_tokens`' last tokens) -> those tokens."""
        if tokens and min(tokens) < 0:
            assert self.fed_tokens is not None, "a placeholder token without a shared step"
            ids.copy_(torch.where(ids < 0, self.fed_tokens[(-1 - ids).clamp(min=0)], ids))

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
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
    def prefill(self, seqs: list[list[int]], cache_keys: list[int] | None = None,
                last_only: bool = False) -> torch.Tensor:
        """CP prefill of new sequences. Returns logits (float32) of every token in flat
        order ([sum L, V]) or, with last_only, of each sequence's last token ([B, V]).
        With a KV cache allocated, each rank keeps the K/V of its own chunk under cache_keys."""
        keys = cache_keys or list(range(len(seqs)))
        return self.extend([Segment(k, s) for k, s in zip(keys, seqs)], last_only)

    @torch.no_grad()
    def extend(self, segments: list[Segment], last_only: bool = True,
               full: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """New tokens of several sequences, each after its `start` cached tokens, CP-split
        over the ranks -> logits (float32) of each segment's last token [B, V] (last_only)
        or of every new token in flat order. `full` (with last_only): segments (indices)
        whose every token's logits follow the B last rows, segment after segment; every
        rank must pass the same (the LM head may gather over ranks)."""
        t0 = time.perf_counter()
        cp = self.groups.attn_cp
        strategy, kv = self.layout.cp_strategy, self.kv
        rotations = None
        if kv is not None and kv.cp_size == cp.size > 1:
            rotations = [kv.rotation(s.key, len(s.ids), strategy) for s in segments]
        split = CPSplit.build([len(s.ids) for s in segments], cp.size, strategy, rotations)
        flat = torch.tensor([t for s in segments for t in s.ids], dtype=torch.int64)
        rel, token_to_seq = split.local_positions(cp.rank), split.local_token_to_seq(cp.rank)
        starts = torch.tensor([s.start for s in segments], dtype=torch.int64)
        runs = query_runs(rel, token_to_seq)
        varlen = (self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                  and not self.own_cache
                  and PackedRuns.wanted(runs, any(s.start for s in segments)))
        host = torch.device("cpu")  # everything is built on the host, then moved at once
        packed = PackedRuns.build(runs, split.cu_seqlens, host) if varlen else None
        batch = ForwardBatch(is_decode=False, input_ids=split.scatter(flat, cp.rank),
                             positions=rel + starts[token_to_seq], token_to_seq=token_to_seq,
                             split=split, rel_positions=rel, q_runs=runs, packed_runs=packed,
                             fp8_attention=(self.fp8_attention and fp8_worth(
                                 runs, [s.start for s in segments])),
                             seq_ends=[max(s.end, s.start + len(s.ids)) for s in segments])
        if self.kv is not None:
            self._store_extend(batch, segments)
        elif any(s.start for s in segments):
            raise ValueError("extending cached sequences needs a KV cache (allocate_kv)")
        last = self._batch_to_device(batch, torch.tensor(split.cu_seqlens[1:]) - 1)
        hidden = self.model.hidden_states(batch)
        if last_only and full:
            cu = split.cu_seqlens
            rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in full]).to(last.device)
            hidden = hidden[torch.cat([last, rows])]
        elif last_only:
            hidden = hidden[last]
        logits = self.model.logits(hidden).float()
        self.times.prefill_s += time.perf_counter() - t0
        return logits

    def _batch_to_device(self, batch: ForwardBatch, last: torch.Tensor) -> torch.Tensor:
        """The extend batch's host-built tensors (and `last`, each sequence's last row) ->
        the device, in place, in one copy (`_upload`) -> `last` there. The split's gathered
        -> flat order travels along (CP > 1: its first use, in layer 0, would copy it)."""
        fields = [(batch, ("input_ids", "positions", "token_to_seq", "rel_positions",
                           "write_slots"))]
        for meta in (batch.packed_runs, batch.prefix):
            if meta is not None:
                fields.append((meta, ("cu_q", "cu_k") + (
                    ("keys",) if isinstance(meta, PackedRuns) else ("q_rows", "slots"))))
        split, cp = batch.split, self.groups.attn_cp.size > 1
        assert split is not None
        parts = [getattr(o, n) for o, names in fields for n in names]
        moved = self._upload(parts + [last] + ([split._gathered_to_flat] if cp else []))
        at = iter(moved)
        for o, names in fields:
            for n in names:
                setattr(o, n, next(at))
        last = next(at)
        if cp and self.device.type != "cpu":  # CPSplit._on's cache: where unpermute looks
            g2f = next(at)
            split._dev_cache[("g2f", g2f.device)] = g2f
        return last

    def _upload(self, parts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Host tensors -> the same on the device (None stays None) in one copy from pinned
        memory, without a stream sync: PyTorch syncs the stream after every copy from
        pageable host memory, and an extend step had ten of them (the last, of `last`,
        after the whole forward was queued). Each comes back as a view of one buffer."""
        if self.device.type == "cpu":
            return parts
        raw = [None if p is None else p.contiguous().view(-1).view(torch.uint8) for p in parts]
        starts, size = [], 0
        for r in raw:  # each part 16-byte aligned, as Triton specializes pointers on it
            starts.append(size)
            size += 0 if r is None else r.numel() + (-r.numel() % 16)
        buf = torch.zeros(max(size, 16), dtype=torch.uint8, pin_memory=True)
        for r, at in zip(raw, starts):
            if r is not None:
                buf[at:at + r.numel()] = r
        dev = buf.to(self.device, non_blocking=True)
        return [None if p is None else dev[at:at + r.numel()].view(p.dtype).view(p.shape)
                for p, r, at in zip(parts, raw, starts)]

    def rows_to_device(self, rows: list[int]) -> torch.Tensor:
        """Row indices -> an int64 device tensor, copied without a stream sync."""
        return self._upload([torch.tensor(rows, dtype=torch.int64)])[0]

    def _store_extend(self, batch: ForwardBatch, segments: list[Segment]) -> None:
        """Pages for every rank's new tokens (all or nothing), their write slots here, and
        where each sequence's cached prefix lies on this rank (host tensors, moved to the
        device with the rest of the batch)."""
        kv, cp, split = self.kv, self.groups.attn_cp, batch.split
        assert kv is not None and split is not None
        news, need = [], [0] * kv.cp_size
        for s, seg in enumerate(segments):
            cached = kv.seqs[seg.key].length if seg.key in kv.seqs else 0
            if cached != seg.start:
                raise ValueError(f"sequence {seg.key}: {cached} tokens cached, the step says "
                                 f"{seg.start}")
            new = [split.seq_counts[r][s] for r in range(cp.size)]
            if kv.cp_size != cp.size:  # a model cache replicated on every CP rank
                new = [sum(new)]
            news.append(new)
            need = [a + b for a, b in zip(need, kv.extend_pages_needed(seg.key, new))]
        if not kv.fits(need):
            r = max(range(kv.cp_size), key=lambda r: need[r] - kv.free_pages(r))
            raise CacheFullError(f"KV cache full: this step needs {need[r]} pages of "
                                 f"{kv.page_size} tokens on CP rank {r}, {kv.free_pages(r)} of "
                                 f"{kv.num_pages} free (--max-total-tokens {kv.capacity})")
        if any(seg.start for seg in segments) and not self.own_cache:
            rows = self._gathered_rows(split, len(segments))
            batch.prefix = PackedPrefix.build(
                [rows[s] for s, seg in enumerate(segments) if seg.start],
                [kv.local_slots(seg.key) for seg in segments if seg.start],
                torch.device("cpu"))
        slots = []
        for seg, new in zip(segments, news):
            slots += kv.extend(seg.key, new)
        batch.kv, batch.cache_keys = kv, [s.key for s in segments]
        batch.write_slots = torch.tensor(slots, dtype=torch.int64)

    def _gathered_rows(self, split: CPSplit, n: int) -> list[torch.Tensor]:
        """Rows of each of the n sequences among the queries all-gathered over CP (every
        rank's local rows padded to split.max_count), in order (host int64)."""
        cp = self.groups.attn_cp
        if cp.size == 1:
            seq = split.local_token_to_seq(0)
        else:
            seq = torch.full((cp.size, split.max_count), n, dtype=torch.int64)
            for r in range(cp.size):
                ids = split.local_token_to_seq(r)
                seq[r, :ids.numel()] = ids
            seq = seq.flatten()
        order = torch.argsort(seq, stable=True)
        return list(order.split(torch.bincount(seq, minlength=n + 1).tolist()))[:n]

    @torch.no_grad()
    def decode(self, keys: list[int], tokens: list[int]) -> torch.Tensor:
        """One new token per sequence -> logits [B, V] (float32). The new K/V goes to the
        CP rank holding the fewest tokens of the sequence (the cache's owner rule). A token
        -(i + 1) is row i of the last `share_tokens` (still on the device)."""
        t0 = time.perf_counter()
        kv = self.kv
        assert kv is not None, "decode needs a KV cache (allocate_kv)"
        positions = [kv.seqs[k].length for k in keys]
        slots = kv.append_decode(keys)
        lens = [kv.local_len(k) for k in keys]
        if self.graphs is not None and self.graphs.fits(len(keys)):
            logits = self.graphs.replay(tokens, positions, slots, lens, keys)
        else:
            # one copy from pinned memory, without a stream sync (as an extend step's)
            meta, table = self._upload([
                torch.tensor([tokens, positions, slots, lens], dtype=torch.int64),
                torch.tensor(kv.block_table(keys), dtype=torch.int32)])
            self.feed(meta[0], tokens)
            batch = ForwardBatch(is_decode=True, input_ids=meta[0], positions=meta[1],
                                 token_to_seq=torch.arange(len(keys), device=self.device), kv=kv,
                                 write_slots=meta[2], block_table=table,
                                 kv_lens=meta[3].to(torch.int32), cache_keys=keys)
            logits = self.model.logits(self.model.hidden_states(batch)).float()
        self.times.decode_s += time.perf_counter() - t0
        self.times.decode_steps += 1
        return logits
