"""The serving engine: one long-lived task on every rank, driven step by step by rank 0.

Each step, rank 0 reads new requests and cancellations from the HTTP server (the link: a
`multiprocessing.connection` to the parent process), asks the `Scheduler` for a `StepPlan`
and broadcasts it over the world group; every rank frees, prefills or decodes exactly what
the plan says, so all ranks issue the same collectives in the same order. Rank 0 then samples
one token per row with each request's own `SamplingParams` and sends the tokens back. The
tokens to feed into the next decode travel inside the next plan, so no other rank samples.

Sampling stream of a served request: `sample(logits, params, [0], step)` with step = number
of tokens the request has generated so far, i.e. prompt index 0 of its own seed. That is what
`cpmoe generate` does for a one-prompt batch, so the same prompt and seed give the same tokens.

Link messages, parent -> rank 0: ("add", scheduler.Request), ("cancel", rid), ("stop",). Rank 0 -> parent: ("ready", rank_pids), then one
("step", [TokenEvent], stats) per step that ran a forward or freed KV, and one per idle tick.

While idle, rank 0 still broadcasts an empty plan every `idle_tick_s` so that the other
ranks, waiting in that broadcast, never reach the collective timeout.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sampling import sample
from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout
from cpmoe.serve.scheduler import Scheduler, StepPlan


@dataclass(frozen=True)
class EngineSpec:
    model_dir: Path
    layout: ParallelLayout
    dtype: torch.dtype
    kv_capacity: int  # KV slots per rank (--max-total-tokens)
    max_prefill_tokens: int
    max_running: int
    eos_ids: tuple[int, ...]
    link_address: tuple[str, int]
    link_authkey: bytes
    idle_tick_s: float = 0.5


def engine_loop_task(info: RankInfo, spec: EngineSpec) -> None:
    # A SIGTERM to the whole process group (systemd, `timeout`) is the server's to handle: it
    # stops this loop cleanly. The pool's own aborts escalate to SIGKILL anyway.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups = ProcessGroups.build(spec.layout, info.rank, info.device)
    runner = ModelRunner(spec.model_dir, groups, spec.dtype, show_progress=False)
    kv = runner.allocate_kv(spec.kv_capacity)
    pids = _gather_ints(runner, os.getpid())
    driver = _Driver(spec, pids) if info.rank == 0 else None
    while True:
        plan = comm.broadcast_object(driver.next_plan() if driver else None, groups.world)
        assert isinstance(plan, StepPlan)
        if plan.stop:
            break
        start = time.perf_counter()
        logits = run_step(runner, plan)
        used = _gather_ints(runner, kv.used)
        if driver is not None:
            driver.finish_step(plan, logits, used, time.perf_counter() - start)
    if driver is not None:
        driver.close()


def run_step(runner: ModelRunner, plan: StepPlan) -> torch.Tensor | None:
    """Free, then prefill or decode; -> logits [rows, V] (float32), None for an empty step."""
    assert runner.kv is not None
    for rid in plan.free:
        runner.kv.free(rid)
    if plan.prefill:
        keys = [rid for rid, _ in plan.prefill]
        return runner.prefill([ids for _, ids in plan.prefill], keys, last_only=True)
    if plan.decode:
        return runner.decode([rid for rid, _ in plan.decode], [t for _, t in plan.decode])
    return None


def _gather_ints(runner: ModelRunner, value: int) -> list[int]:
    """One int from every rank, in rank order, on every rank."""
    mine = torch.tensor([value], dtype=torch.int64, device=runner.device)
    return [int(v) for v in runner.gather_from_ranks(mine)]


class _Driver:
    """Rank 0's side: the link to the HTTP server, the scheduler and the sampling."""

    def __init__(self, spec: EngineSpec, rank_pids: list[int]) -> None:
        self.spec = spec
        self.sched = Scheduler(spec.kv_capacity, spec.max_prefill_tokens, spec.max_running,
                               spec.eos_ids)
        self.conn: Connection = Client(spec.link_address, authkey=spec.link_authkey)
        self.conn.send(("ready", rank_pids))
        self.stopping = False

    def next_plan(self) -> StepPlan:
        # Block (up to one idle tick) only when there is nothing to do.
        timeout = 0.0 if self.sched.has_work() else self.spec.idle_tick_s
        while not self.stopping and self.conn.poll(timeout):
            self._handle(self.conn.recv())
            timeout = 0.0
        return StepPlan(stop=True) if self.stopping else self.sched.plan()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "add":
            self.sched.add(msg[1])
        elif msg[0] == "cancel":
            self.sched.cancel(msg[1])
        elif msg[0] == "stop":
            self.stopping = True
        else:
            raise ValueError(f"unknown link message {msg[0]!r}")

    def finish_step(self, plan: StepPlan, logits: torch.Tensor | None, kv_used: list[int],
                    step_s: float) -> None:
        events = []
        if logits is not None:
            tokens = []
            for row, rid in enumerate(plan.rows):
                req = self.sched.running[rid]
                tokens += sample(logits[row:row + 1], req.params, [0], req.generated)
            events = self.sched.record(plan, tokens)
        stats = {"kind": "prefill" if plan.prefill else "decode" if plan.decode else "idle",
                 "step_s": step_s, "running": len(self.sched.running),
                 "waiting": len(self.sched.waiting), "kv_used": kv_used,
                 "kv_reserved": self.sched.reserved,
                 "prefill_tokens": sum(len(ids) for _, ids in plan.prefill)}
        self.conn.send(("step", events, stats))

    def close(self) -> None:
        self.conn.close()
