"""Rank tasks of the prefix-cache tests (module-level, so spawned ranks can import them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cpmoe.engine.engine import BatchFrontend, Driver, engine_loop
from cpmoe.engine.options import EngineOptions
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.engine.sampling import SamplingParams
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import Request, TokenEvent
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


@dataclass
class Turn:
    """A prompt: `suffix` after (if `after` is set) that earlier turn's prompt and answer."""

    suffix: list[int]
    after: int | None = None


@dataclass
class _Turns(BatchFrontend):
    """Submits every turn whose earlier turn is done (all at once when none depends on
    another); records each request's cached_tokens."""

    turns: list[Turn] = field(default_factory=list)
    max_tokens: int = 4
    cached: dict[int, int] = field(default_factory=dict)
    prompts: dict[int, list[int]] = field(default_factory=dict)
    _submitted: set[int] = field(default_factory=set)

    def poll(self, timeout: float) -> list[tuple]:
        msgs = []
        for i, turn in enumerate(self.turns):
            if i in self._submitted or (turn.after is not None and turn.after not in
                                        self.cached):
                continue
            head = ([] if turn.after is None else
                    self.prompts[turn.after] + self.outputs[turn.after])
            self.prompts[i] = head + turn.suffix
            self._submitted.add(i)
            msgs.append(("add", Request(i, self.prompts[i], SamplingParams(), self.max_tokens,
                                        stream=i, ignore_eos=True)))
        if len(self.cached) == len(self.turns):
            msgs.append(("stop",))
        return msgs

    def emit(self, events: list[TokenEvent], stats: dict) -> None:
        for ev in events:
            self.outputs.setdefault(ev.rid, []).append(ev.token)
            if ev.finish is not None:
                self.cached[ev.rid] = ev.cached_tokens

    def result(self) -> dict:
        n = len(self.turns)
        return {"tokens": [self.outputs[i] for i in range(n)],
                "cached": [self.cached[i] for i in range(n)],
                "prompts": [self.prompts[i] for i in range(n)]}


def _run(runner: ModelRunner, turns: list[Turn], opts: EngineOptions, max_tokens: int,
         kv_tokens: int, radix: bool) -> dict | None:
    runner.allocate_kv(kv_tokens, opts.page_size)
    driver, steps = None, []
    if runner.groups.rank == 0:
        sched = Scheduler(runner.kv, runner.layout.cp_strategy, opts.chunked_prefill_size,
                          opts.max_running_requests, (), radix=radix)
        driver = Driver(runner, sched, _Turns([], turns=turns, max_tokens=max_tokens),
                        observe=steps.append)
    out = engine_loop(runner, driver)
    left = runner.kv.rank_pages
    runner.kv = None
    if driver is None:
        return None
    return {**out, "steps": steps, "evictions": driver.sched.evictions,
            "preemptions": driver.sched.preemptions, "pages_left": left}


def engine_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                cases: dict[str, tuple[list[Turn], EngineOptions, int, int]]) -> dict | None:
    """Each case (turns, options, max_tokens, KV slots per rank) with the prefix cache on
    and off -> rank 0: {case: {"on": result, "off": result}}."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    out = {}
    for name, (turns, opts, max_tokens, kv_tokens) in cases.items():
        out[name] = {mode: _run(runner, turns, opts, max_tokens, kv_tokens, mode == "on")
                     for mode in ("on", "off")}
    return out if info.rank == 0 else None


def fork_task(info: RankInfo, layout: ParallelLayout, model_dir: Path, first: list[int],
              second: list[int], shared: int) -> dict:
    """`first` prefilled in one piece into one-token pages; a sequence forked from its first
    `shared` tokens, then the rest of `second` extended after them -> the logits of that
    extend, the same prompt prefilled without a cache, and each rank's tokens of the
    forked prefix (what it stores of it; pages of one token: no rounding)."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    whole = runner.prefill([second], last_only=False)[shared:]
    out = {"whole": whole}
    for page_size in (1, 4):
        kv = runner.allocate_kv(4 * (len(first) + len(second)), page_size)
        runner.extend([Segment(0, first)])
        kv.fork(1, 0, shared)
        held = [len(p) * page_size for p in kv.seqs[1].rank_pages]
        forked = runner.extend([Segment(1, second[shared:], shared)], last_only=False)
        kv.free(0)
        kv.free(1)
        out[page_size] = {"logits": forked, "prefix_slots": held,
                          "pages_left": list(kv.rank_pages)}
    runner.kv = None
    return out
