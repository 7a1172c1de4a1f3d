"""Continuous batching on rank 0: which requests to prefill, which to decode, at each step.

Pure bookkeeping (no torch, no processes), so its rules are testable on their own.

Invariants:
- A step is either one prefill batch or one decode step over every running request, never
  both: a long prompt's prefill is a step of its own, and after a prefill step the running
  requests decode next (prefill and decode alternate while both have work).
- A request's KV need is reserved at admission as `kv_slots_needed` of its prompt alone at
  its full `max_tokens` (the busiest CP rank). A batch's CP split and the decode placement
  are per sequence, so the sum of these reservations bounds every rank's use: an admitted
  request can never hit a full cache.
- Admission is FIFO: the head of the queue waits for room rather than being overtaken.
- Finished and cancelled requests are freed on every rank by the next step's plan, before
  that step's prefill; their reservation is released when the plan is made.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cpmoe.engine.sampling import SamplingParams


@dataclass(frozen=True)
class StepPlan:
    """What every rank does in one step; built on rank 0 and broadcast to all ranks."""

    free: list[int] = field(default_factory=list)  # request ids whose KV to free first
    prefill: list[tuple[int, list[int]]] = field(default_factory=list)  # (id, prompt ids)
    decode: list[tuple[int, int]] = field(default_factory=list)  # (id, token to feed)
    stop: bool = False  # leave the engine loop

    @property
    def rows(self) -> list[int]:
        """Request id of each row of this step's logits."""
        return [rid for rid, _ in self.prefill or self.decode]


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    kv_need: int  # slots reserved on the busiest CP rank
    ignore_eos: bool = False  # run to max_tokens (load tests, benchmarks)
    generated: int = 0
    last_token: int = -1


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of a request; `finish` is "stop" (EOS), "length" or None."""

    rid: int
    token: int
    finish: str | None


class Scheduler:
    def __init__(self, kv_capacity: int, max_prefill_tokens: int, max_running: int,
                 eos_ids: tuple[int, ...]) -> None:
        self.kv_capacity = kv_capacity
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # in admission order
        self.reserved = 0
        self._to_free: list[int] = []
        self._last_was_prefill = False

    def add(self, req: Request) -> None:
        if req.kv_need > self.kv_capacity:  # the server refuses these (400) before sending
            raise ValueError(f"request {req.rid} needs {req.kv_need} KV slots, capacity "
                             f"{self.kv_capacity}")
        self.waiting.append(req)

    def cancel(self, rid: int) -> None:
        """Drop a request wherever it is; unknown ids (already finished) are ignored."""
        if rid in self.running:
            self._release(self.running.pop(rid))
            return
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_free)

    def plan(self) -> StepPlan:
        free, self._to_free = self._to_free, []
        if self.waiting and (not self.running or not self._last_was_prefill):
            batch = self._admit()
            if batch:
                self._last_was_prefill = True
                return StepPlan(free=free, prefill=[(r.rid, r.prompt) for r in batch])
        self._last_was_prefill = False
        return StepPlan(free=free,
                        decode=[(r.rid, r.last_token) for r in self.running.values()])

    def _admit(self) -> list[Request]:
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            if self.reserved + head.kv_need > self.kv_capacity:
                break
            if batch and tokens + len(head.prompt) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.reserved += head.kv_need
            self.running[head.rid] = head
            batch.append(head)
            tokens += len(head.prompt)
        return batch

    def record(self, plan: StepPlan, tokens: list[int]) -> list[TokenEvent]:
        """Take the sampled token of each row of `plan`; finished requests leave `running`."""
        events = []
        for rid, token in zip(plan.rows, tokens, strict=True):
            req = self.running[rid]
            req.generated += 1
            req.last_token = token
            eos = token in self.eos_ids and not req.ignore_eos
            finish = ("stop" if eos else
                      "length" if req.generated >= req.max_tokens else None)
            if finish is not None:
                self._release(self.running.pop(rid))
            events.append(TokenEvent(rid, token, finish))
        return events

    def _release(self, req: Request) -> None:
        self.reserved -= req.kv_need
        self._to_free.append(req.rid)  # every running request was prefilled: KV on all ranks
