"""CUDA graphs of the decode forward: one graph per batch-size bucket.

A decode step's inputs live in static buffers (token ids, positions, write slots, this
rank's KV lengths and block table); a step copies its rows into them, pads the rest of the
bucket (padded rows read no KV and write to the cache's trash slot), replays the bucket's
graph and reads its logits. Graphs are captured largest first into one memory pool, after
one eager warm-up per bucket (which also initialises every collective the forward issues:
multi-rank layouts capture their NCCL collectives inside the graphs). Batches above the
largest bucket run eagerly. Prefill (extend) always runs eagerly.

Nothing in the decode forward may synchronise with the host: the Qwen model's decode path
is written so (no `.item()`, no data-dependent shapes); a layout whose dispatch exchanges
counts through the host (`--moe-a2a-backend alltoall`) is not captured.
"""

from __future__ import annotations

import torch

from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.graph_capture import batch_buckets, capture


class DecodeGraphs:
    def __init__(self, runner, max_bs: int, max_pages: int) -> None:
        self.runner = runner
        dev = runner.device
        kv = runner.kv
        self.max_bs, self.max_pages = max_bs, max_pages
        self.ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_bs,), kv.trash_slot, dtype=torch.int64, device=dev)
        self.lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.table = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=dev)
        # per table row: (its sequence's page list, pages of it written); the list object,
        # not the key, names the sequence: a preempted request re-admitted under its old id
        # gets a new list (new pages) and must be rewritten
        self._rows: list[tuple[list[int], int]] = []
        self.buckets = batch_buckets(max_bs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        before = torch.cuda.memory_allocated(dev)
        pool = None
        for bs in reversed(self.buckets):
            graph, out = self._capture(bs, pool)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_allocated(dev) - before

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(is_decode=True, input_ids=self.ids[:bs],
                            positions=self.positions[:bs],
                            token_to_seq=torch.arange(bs, device=self.ids.device),
                            kv=self.runner.kv, write_slots=self.slots[:bs],
                            block_table=self.table[:bs], kv_lens=self.lens[:bs])

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        model = self.runner.model
        return model.logits(model.hidden_states(batch)).float()

    def _capture(self, bs: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._batch(bs)
        return capture(lambda: self._forward(batch), self.ids.device, pool)

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def replay(self, tokens: list[int], positions: list[int], slots: list[int],
               lens: list[int], keys: list[int]) -> torch.Tensor:
        """One decode step of len(tokens) rows (sequences `keys` of the runner's cache) ->
        logits [rows, V] (valid until the next replay)."""
        n = len(tokens)
        bs = next(b for b in self.buckets if b >= n)
        trash = self.runner.kv.trash_slot
        pad = bs - n
        meta = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots + [trash] * pad,
                             lens + [0] * pad], dtype=torch.int64)
        meta = meta.pin_memory().to(self.ids.device, non_blocking=True)
        self.ids[:bs].copy_(meta[0])
        self.runner.feed(self.ids[:n], tokens)
        self.positions[:bs].copy_(meta[1])
        self.slots[:bs].copy_(meta[2])
        self.lens[:bs].copy_(meta[3])
        self._update_table(keys)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]

    def _update_table(self, keys: list[int]) -> None:
        """Write what changed in the block table since the last step (`table_updates`)."""
        pages = [self.runner.kv.seqs[k].pages for k in keys]
        for key, row in zip(keys, pages):
            if len(row) > self.max_pages:
                raise ValueError(f"sequence {key} holds {len(row)} pages on this rank, the "
                                 f"decode graphs were captured for {self.max_pages}")
        rows, cols, vals = table_updates(self._rows, pages)
        if rows:
            upd = torch.tensor([rows, cols, vals], dtype=torch.int64).pin_memory()
            upd = upd.to(self.ids.device, non_blocking=True)
            self.table[upd[0], upd[1]] = upd[2].to(torch.int32)


def table_updates(written: list[tuple[list[int], int]], pages: list[list[int]]
                  ) -> tuple[list[int], list[int], list[int]]:
    """(rows, cols, page ids) to write so that table row i holds pages[i], given what each
    row holds (`written`: the page list it was written from and how many of its entries;
    updated in place). A row that kept its sequence gains at most one page per step; a row
    whose page list is another object (another sequence, or the same request id freed and
    stored again, as after preemption) is rewritten. Entries past a row's pages are never
    read, so stale ones may stay."""
    rows, cols, vals = [], [], []
    for i, row_pages in enumerate(pages):
        have = written[i] if i < len(written) else None
        first = have[1] if have is not None and have[0] is row_pages else 0
        for j in range(first, len(row_pages)):
            rows.append(i)
            cols.append(j)
            vals.append(row_pages[j])
    written[:len(pages)] = [(p, len(p)) for p in pages]
    return rows, cols, vals
