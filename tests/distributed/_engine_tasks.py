"""Rank tasks of the engine tests (module-level, so spawned ranks can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from cpmoe.engine.engine import BatchFrontend, Driver, engine_loop
from cpmoe.engine.options import EngineOptions
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.engine.sampling import SamplingParams
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import Request, TokenEvent
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


def chunked_prefill_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                         seqs: list[list[int]], chunks: list[int]) -> dict:
    """All-position logits of the prompts prefilled at once (no cache), and chunk by chunk
    through the cache (every prompt's chunk i in step i), with the KV bytes each rank holds
    afterwards (one-token pages: no page rounding)."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    out = {"whole": runner.prefill(seqs), "chunked": {}, "kv_bytes": {}}
    for chunk in chunks:
        kv = runner.allocate_kv(sum(len(s) for s in seqs), page_size=1)
        pieces: list[list[torch.Tensor]] = [[] for _ in seqs]
        done = [0] * len(seqs)
        while any(d < len(s) for d, s in zip(done, seqs)):
            segs = [Segment(i, s[d:d + chunk], d) for i, (s, d) in enumerate(zip(seqs, done))
                    if d < len(s)]
            logits = runner.extend(segs, last_only=False)
            for seg, part in zip(segs, logits.split([len(g.ids) for g in segs])):
                pieces[seg.key].append(part)
                done[seg.key] += len(seg.ids)
        out["chunked"][chunk] = torch.cat([torch.cat(p) for p in pieces])
        out["kv_bytes"][chunk] = kv.nbytes_used()
    runner.kv = None
    out["kv_bytes_per_token"] = runner.kv_bytes_per_token()
    return out


def preemption_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                    seqs: list[list[int]], new_tokens: int, sampling: SamplingParams,
                    max_tokens: int | None) -> dict:
    """Tokens of a batch generated with plenty of KV, or in `max_tokens` slots per rank
    (pages of 4, prompts chunked by 8) so requests must wait and be preempted."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    opts = EngineOptions(page_size=4, chunked_prefill_size=8)
    preempted = []
    if max_tokens is not None:
        runner.allocate_kv(max_tokens, opts.page_size)
    tokens = _generate_counting(runner, seqs, new_tokens, sampling, opts, preempted)
    return {"tokens": tokens, "preemptions": preempted[0] if preempted else None,
            "kv_used_after": runner.kv.used}


def _generate_counting(runner, seqs, new_tokens, sampling, opts, preempted) -> list:
    if runner.kv is None:
        return generate(runner, seqs, new_tokens, (), sampling, options=opts)
    driver = None
    if runner.groups.rank == 0:
        requests = [Request(i, list(p), sampling, new_tokens, stream=i)
                    for i, p in enumerate(seqs)]
        sched = Scheduler(runner.kv, runner.layout.cp_strategy, opts.chunked_prefill_size,
                          opts.max_running_requests, ())
        driver = Driver(runner, sched, BatchFrontend(requests))
    tokens = engine_loop(runner, driver)
    if driver is not None:
        preempted.append(driver.sched.preemptions)
    return tokens


class _Timeline(BatchFrontend):
    """Adds the long request once the short ones have had two steps; records who got a
    token in which step and how many prompt tokens that step prefilled."""

    def __init__(self, short: list[Request], long: Request) -> None:
        super().__init__(short + [long])
        self.short, self.long, self.steps, self._long_sent = short, long, [], False

    def poll(self, timeout: float) -> list[tuple]:
        if not self._sent:
            self._sent = True
            return [("add", r) for r in self.short]
        if len(self.steps) == 2 and not self._long_sent:
            self._long_sent = True
            return [("add", self.long)]
        return [("stop",)] if self._done == len(self.requests) else []

    def emit(self, events: list[TokenEvent], stats: dict) -> None:
        super().emit(events, stats)
        self.steps.append({"rids": [e.rid for e in events],
                           "prefill_tokens": stats["prefill_tokens"]})


def streaming_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                   short: list[list[int]], long: list[int], chunk: int) -> list | None:
    """Short requests decoding, then a long prompt arrives: per step, who got tokens."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    runner.allocate_kv(4096, 16)
    driver = frontend = None
    if info.rank == 0:
        params = SamplingParams()
        reqs = [Request(i, p, params, 40, stream=i) for i, p in enumerate(short)]
        frontend = _Timeline(reqs, Request(len(short), long, params, 2, stream=len(short)))
        sched = Scheduler(runner.kv, layout.cp_strategy, chunk, 64, ())
        driver = Driver(runner, sched, frontend)
    engine_loop(runner, driver)
    return frontend.steps if frontend is not None else None
