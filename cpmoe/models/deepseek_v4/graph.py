"""CUDA graphs of the DeepSeek-V4 decode step (the runner's `graphs` for V4; Qwen's are
engine/cuda_graph.py; both capture through graph_capture.py).

A V4 step reads each row's compressed entries through page columns (`DecodeStep`), so the
work of a step grows with the longest row's context: a graph is captured per (batch bucket,
context bucket), the context buckets powers of two from 512 tokens up to the cache's limit,
each on first use (a server sees few of them; capturing every pair up front would take
minutes at a 1M-token limit). Inputs live in static buffers sized for the largest pair:
token ids, positions and the `DecodeStep` indices (the rows' entry pages are read from the
cache's device page table); a step takes its books from the cache
(`V4Cache.prepare_decode`, host), copies them into the buffers (padded rows: trash slot,
no entries), replays and returns the logits (valid until the next replay).

Capturing on first use is safe because a step is idempotent: the warm-up run before the
capture executes the step for real, and running it again (the replay) writes the same
rows and entries -- every value a step reads was either written before the step or by the
same step before it is read, and what it overwrites (position p - W in the window ring,
p - R in a compressor ring) it does not read.
"""

from __future__ import annotations

import torch

from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.graph_capture import batch_buckets, capture
from cpmoe.models.deepseek_v4.cache import V4Cache, _owned
from cpmoe.models.deepseek_v4.state import ENTRY_PAGE, DecodeStep

MIN_CONTEXT_BUCKET = 512


class V4DecodeGraphs:
    def __init__(self, runner, max_bs: int, max_context: int) -> None:
        kv = runner.kv
        assert isinstance(kv, V4Cache)
        self.runner, self.kv, self.max_bs = runner, kv, max_bs
        self.max_context = max(1, max_context)
        self.buckets = batch_buckets(max_bs)
        dev = runner.device

        def full(value: int, *shape: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=dev)

        self.ids, self.positions = full(0, max_bs), full(0, max_bs)
        self.step = DecodeStep(full(kv.trash_seq, max_bs),
                               {m: full(kv.trash_entry[m], max_bs) for m in kv.rates},
                               {m: full(0, max_bs) for m in kv.rates}, {})
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.memory_bytes = 0  # graphs are captured on first use

    def _context_bucket(self, tokens: int) -> int:
        bucket = MIN_CONTEXT_BUCKET
        while bucket < tokens:
            bucket *= 2
        return min(bucket, max(self.max_context, MIN_CONTEXT_BUCKET))

    def _widths(self, context: int) -> dict[int, int]:
        """Page columns a row of `context` tokens can need at each rate (on CP rank 0, which
        holds the most entries)."""
        cp_size, table = self.kv.shard[1], self.kv.page_table
        return {m: min(table[m].shape[1],
                       max(1, -(-_owned(context // m, 0, cp_size) // ENTRY_PAGE)))
                for m in self.kv.rates}

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def replay(self, tokens: list[int], positions: list[int], slots: list[int],
               lens: list[int], keys: list[int]) -> torch.Tensor:
        """One decode step of len(tokens) rows (sequences `keys`, their tokens already
        counted by the cache) -> logits [rows, V]. Rows past the largest context bucket run
        eagerly."""
        n, longest = len(tokens), max(positions) + 1
        if longest > self.max_context:
            return self._eager(tokens, positions, keys)
        bs = next(b for b in self.buckets if b >= n)
        context = self._context_bucket(longest)
        widths = self._widths(context)
        kv = self.kv
        host = kv.prepare_decode(keys).tensors(bs, widths, kv.trash_seq, kv.trash_entry)
        pad = [0] * (bs - n)
        step = self.step.rows(bs, widths)
        dsts = ([self.ids[:bs], self.positions[:bs], step.seq_slot]
                + [step.write[m] for m in kv.rates] + [step.count[m] for m in kv.rates])
        cols = torch.stack([torch.tensor(tokens + pad, dtype=torch.int64),
                            torch.tensor(positions + pad, dtype=torch.int64), host.seq_slot]
                           + [host.write[m] for m in kv.rates]
                           + [host.count[m] for m in kv.rates])
        for dst, src in zip(dsts, self._upload(cols)):
            dst.copy_(src)
        self.runner.feed(self.ids[:n], tokens)
        graph = self.graphs.get((bs, context))
        if graph is None:
            graph = self.graphs[(bs, context)] = self._capture(bs, step)
        graph[0].replay()
        return graph[1][:n]

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        dev = self.ids.device
        return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(is_decode=True, input_ids=self.ids[:bs],
                            positions=self.positions[:bs],
                            token_to_seq=torch.arange(bs, device=self.ids.device), kv=self.kv)

    def _forward(self, batch: ForwardBatch, step: DecodeStep) -> torch.Tensor:
        model = self.runner.model
        return model.logits(model.model(batch, step)).float()

    def _capture(self, bs: int, step: DecodeStep) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        dev = self.ids.device
        batch = self._batch(bs)
        before = torch.cuda.memory_allocated(dev)
        # the warm-up is a real step, idempotent (see above)
        graph, out = capture(lambda: self._forward(batch, step), dev, self.pool)
        self.pool = graph.pool()
        self.memory_bytes += max(0, torch.cuda.memory_allocated(dev) - before)
        return graph, out

    def _eager(self, tokens: list[int], positions: list[int], keys: list[int]) -> torch.Tensor:
        dev = self.ids.device
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        self.runner.feed(ids, tokens)
        batch = ForwardBatch(is_decode=True, input_ids=ids,
                             positions=torch.tensor(positions, dtype=torch.int64, device=dev),
                             token_to_seq=torch.arange(len(keys), device=dev), kv=self.kv,
                             cache_keys=keys)
        model = self.runner.model
        return model.logits(model.model(batch)).float()
