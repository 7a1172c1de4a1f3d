"""The one step loop of `cpmoe generate` and `cpmoe serve`, run by every rank.

Each step rank 0's `Driver` takes new requests and cancellations from its frontend (a fixed
batch for generate, the HTTP server's link for serve), asks the `Scheduler` for a
`StepPlan` and broadcasts it over the world group; every rank runs exactly that plan (frees,
one extend forward, one decode forward), so all ranks issue the same collectives in the
same order. Rank 0 then samples one token for each row that completed a prompt or decoded,
and hands the tokens to the frontend. Tokens to feed into the next decode travel inside the
next plan, so no other rank samples, and the plan is the only per-step message.

A row's penalties, logit_bias and min_tokens are applied to its logits before the choice
(logits.py); requests that ask for logprobs get log_softmax of the row's logits (after a
grammar's mask, before penalties) for the chosen token and the top k in their TokenEvent,
computed on rank 0 only. Requests that ask for prompt logprobs have every row of their
prompt's extend scored (StepPlan.prompt_logits): log_softmax at each prompt position for the
next prompt token, handed out with the request's first token.

Grammars (structured output, grammar.py): each step, rank 0 fills the bitmask of the rows
whose request has one on the host, after the forward was launched (so on a GPU the fill runs
while the device computes), and applies it to the step's logits on the device before the
choice; a matcher advances when its token reaches the host.

Overlap (SGLang's overlap schedule; `--disable-overlap-schedule` turns it off): when every
row of a step is a plain greedy choice, rank 0 takes the argmax on the device, every rank
keeps those tokens (broadcast over the world group) as the feed of the next step's decode
rows (placeholders in the plan, see scheduler.py), and the copy to the host is waited for
only after the next step was planned and launched. The host's planning then runs while the
device computes, instead of between steps. Rows that sample, adjust logits or return
logprobs (and steps an observer watches) take the tokens to the host first, as before.
Greedy rows with a grammar overlap too: a step's masks need the previous step's tokens, so
rank 0 waits for those after launching the step's forward, advances the matchers, fills the
masks while the forward runs, and masks the logits before the argmax on the device.

Sampling stream of a request: `(seed, stream, tokens generated so far)`: prompt i of a
generate batch uses stream i, choice i of a served request (n choices, several prompts)
stream i, so the same prompts and seed give the same tokens through both (and after a
preemption).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cpmoe.engine.grammar import GrammarBackend, GrammarError, apply_token_bitmask
from cpmoe.engine.logits import adjust_logits, prompt_logprobs, token_logprobs
from cpmoe.engine.profiler import ProfileCommand, StepProfiler
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.engine.sampling import sample
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import Request, StepPlan, TokenEvent
from cpmoe.parallel import comm


@dataclass
class StepOutput:
    logits: torch.Tensor | None  # float32 [rows, V]: `Scheduler.sample_rows(plan)` order
    kind: str  # "prefill", "decode", "mixed" or "idle"
    started: float  # time.perf_counter() when the step began; the step ends once its tokens
    # are on the host (rank 0's `Driver.finish_step`), as the forward alone only queues work
    sampled: "DeviceTokens | None" = None  # with plan.overlap: the greedy tokens


class DeviceTokens:
    """A step's greedy tokens on the device and their copy to the host, started at once so
    that waiting for it does not wait for the steps queued after it."""

    def __init__(self, tokens: torch.Tensor) -> None:
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens, None

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


def run_step(runner: ModelRunner, plan: StepPlan, sched: Scheduler | None,
             masks: Callable[[StepPlan], torch.Tensor | None] | None = None) -> StepOutput:
    """Every rank: free, fork cached prefixes, then the decode forward and the extend
    forward of the plan. On rank 0 (sched given) -> the logits of the rows to sample, masked
    by `masks(plan)` (the grammars' bitmask of those rows, or None); with plan.overlap,
    every rank keeps rank 0's greedy tokens as the next step's feed."""
    start = time.perf_counter()
    assert runner.kv is not None
    for rid in plan.free:
        runner.kv.free(rid)
    for rid in plan.cache:
        runner.kv.mark_cached(rid)
    runner.kv.fork_many(plan.fork)
    parts = []
    if plan.decode:
        parts.append(runner.decode([r for r, _ in plan.decode], [t for _, t in plan.decode]))
    if plan.extend:
        scored = set(plan.prompt_logits)
        full = [i for i, (rid, _, _) in enumerate(plan.extend) if rid in scored]
        ends = plan.extend_ends or [0] * len(plan.extend)
        logits = runner.extend([Segment(r, ids, s, e) for (r, ids, s), e
                                in zip(plan.extend, ends)], full=full)
        if full:
            if sched is not None:
                _score_prompts(sched, [plan.extend[i] for i in full],
                               logits[len(plan.extend):])
            logits = logits[:len(plan.extend)]
        if sched is not None:  # the sequences whose prompt this step completes
            done = [i for i, (rid, ids, s) in enumerate(plan.extend)
                    if s + len(ids) == len(sched.running[rid].tokens)]
            if len(done) == len(plan.extend):
                parts.append(logits)
            elif done:  # rows picked on the device: a Python-list index would sync
                parts.append(logits.index_select(0, runner.rows_to_device(done)))
    out = None
    if parts and sched is not None:
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        mask = masks(plan) if masks is not None else None
        if mask is not None:
            out = apply_token_bitmask(out, mask)
    sampled = None
    if plan.overlap:
        mine = out.argmax(dim=-1) if out is not None else None
        sampled = DeviceTokens(runner.share_tokens(mine, plan.samples))
    return StepOutput(out, plan.kind, start, sampled)


def _score_prompts(sched: Scheduler, segments: list[tuple[int, list[int], int]],
                   logits: torch.Tensor) -> None:
    """Rank 0: the prompt log-probabilities of these extend segments (their every row's
    logits, segment after segment) into their requests' `prompt_lps`."""
    at = 0
    for rid, ids, start in segments:
        req = sched.running[rid]
        targets = req.prompt[start + 1:start + len(ids) + 1]
        entries = prompt_logprobs(logits[at:at + len(ids)], targets, req.prompt_logprobs or 0)
        del req.prompt_lps[start:]  # a prompt prefilled again (preempted) replaces its own
        req.prompt_lps.extend(entries)
        at += len(ids)


def choose_tokens(logits: torch.Tensor, rows: list[Request],
                  eos_ids: frozenset[int] | tuple[int, ...] = ()) -> list[int]:
    """One token per row, each from its request's own sampling stream. The plain greedy rows
    take one argmax and one copy to the host together (a step of 128 greedy streams would
    otherwise wait on 128 copies); sampled rows and rows with penalties or min_tokens
    (`adjust_logits`) go one by one through `sample`."""
    plain = [i for i, req in enumerate(rows) if _argmax_row(req)]
    tokens = [0] * len(rows)
    if plain:
        picked = logits if len(plain) == len(rows) else logits[plain]
        for i, t in zip(plain, picked.argmax(dim=-1).tolist()):
            tokens[i] = t
    done = set(plain)
    for i, req in enumerate(rows):
        if i in done:
            continue
        row = logits[i:i + 1]
        if req.params.adjusts_logits:
            row = adjust_logits(logits[i], req, eos_ids)[None]
        tokens[i] = sample(row, req.params, [req.stream], req.generated)[0]
    return tokens


def row_logprobs(logits: torch.Tensor, rows: list[Request], tokens: list[int]
                 ) -> list[tuple[float, tuple] | None] | None:
    """(logprob, top) of the chosen token for the rows whose request asks; None if none."""
    if all(req.logprobs is None for req in rows):
        return None
    return [None if req.logprobs is None else token_logprobs(logits[i], tokens[i], req.logprobs)
            for i, req in enumerate(rows)]


class Frontend:
    """Where rank 0's driver gets requests from and sends tokens to."""

    def poll(self, timeout: float) -> list[tuple]:
        """Messages ("add", Request) / ("cancel", rid) / ("profile", ProfileCommand) /
        ("stop",), waiting up to timeout."""
        raise NotImplementedError

    def emit(self, events: list[TokenEvent], stats: dict) -> None:
        raise NotImplementedError

    def result(self) -> object:
        """What the loop returns on every rank when it stops."""
        return None


class Driver:
    """Rank 0's side of the loop: the scheduler, the frontend and the sampling."""

    def __init__(self, runner: ModelRunner, sched: Scheduler, frontend: Frontend,
                 idle_tick_s: float = 0.5,
                 observe: Callable[[torch.Tensor], None] | None = None,
                 overlap: bool = True, grammars: GrammarBackend | None = None) -> None:
        self.runner, self.sched, self.frontend = runner, sched, frontend
        self.idle_tick_s, self.observe = idle_tick_s, observe
        self.overlap = overlap and observe is None
        self.grammars = grammars
        self.stopping = False
        # an overlapped step whose tokens are not on the host yet: (its rows, its tokens)
        self._in_flight: tuple[list, DeviceTokens] | None = None
        self._advanced = False  # the in-flight step's tokens went into their matchers
        self._failed: list[Request] = []  # requests whose grammar failed to compile
        self._profile: ProfileCommand | None = None  # for the next plan
        layout = runner.layout
        self._cp_coords = [layout.coords(r)["attn_cp"] for r in range(layout.world_size)]

    def next_plan(self) -> StepPlan:
        timeout = 0.0 if self.sched.has_work() else self.idle_tick_s
        for msg in self.frontend.poll(timeout):
            if msg[0] == "add":
                self._add(msg[1])
            elif msg[0] == "cancel":
                self.sched.cancel(msg[1])
            elif msg[0] == "profile":
                self._profile = msg[1]
            elif msg[0] == "stop":
                self.stopping = True
            else:
                raise ValueError(f"unknown engine message {msg[0]!r}")
        if self.stopping:  # free what finished requests hold first: leave the cache empty
            # a step still in flight at a server's stop: its tokens have no reader left
            # (generate stops only once its last token has landed)
            self._in_flight = None
            self.sched.clear_cache()
            frees = self.sched.take_frees()
            return (StepPlan(free=frees) if frees else
                    StepPlan(stop=True, result=self.frontend.result()))
        plan = self.sched.plan()
        if plan.empty and self.sched.waiting and not self.sched.running:
            raise RuntimeError(f"scheduler stuck: {len(self.sched.waiting)} waiting requests "
                               f"fit no KV pages although nothing runs")
        rows = self.sched.sample_rows(plan)
        if self.overlap and rows and all(_plain(req) for req in rows):
            plan = dataclasses.replace(plan, overlap=True, samples=len(rows))
        if self._profile is not None:
            plan, self._profile = dataclasses.replace(plan, profile=self._profile), None
        return plan

    def _add(self, req: Request) -> None:
        if req.grammar is not None:
            if self.grammars is None:
                raise ValueError("a request with a grammar reached an engine without one")
            req.matcher = self.grammars.row(req.grammar)
        self.sched.add(req)

    def masks(self, plan: StepPlan) -> torch.Tensor | None:
        """Rank 0, after the step's forward was launched: the bitmask of its sampled rows, or
        None if no row has a grammar. The in-flight step's tokens advance the matchers
        first; a request whose grammar failed to compile is cancelled (finish "abort")."""
        rows = self.sched.sample_rows(plan)
        if self.grammars is None or all(req.matcher is None for req in rows):
            return None
        self._advance_in_flight()
        for req in rows:
            if req.matcher is not None:
                try:
                    req.matcher.ready()
                except (GrammarError, RuntimeError, ValueError) as e:
                    self._fail(req, e)
        return self.grammars.fill([req.matcher for req in rows])

    def _fail(self, req: Request, err: Exception) -> None:
        """Its row samples unconstrained this step; `_drop_failed` then cancels it."""
        print(f"cpmoe: request {req.rid}: its grammar does not compile ({err}); aborted",
              file=sys.stderr, flush=True)
        req.matcher = None
        self._failed.append(req)

    def _drop_failed(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """After a step was accounted: cancel the requests whose grammar failed, their
        tokens replaced by one event with finish "abort"."""
        failed, self._failed = {req.rid: req for req in self._failed}, []
        events = [ev for ev in events if ev.rid not in failed]
        eos = min(self.sched.eos_ids, default=0)
        for rid, req in failed.items():
            if not req.done:
                self.sched.cancel(rid)
            events.append(TokenEvent(rid, eos, "abort"))
        return events

    @staticmethod
    def _advance(reqs: list[Request], tokens: list[int]) -> None:
        for req, token in zip(reqs, tokens, strict=True):
            if req.matcher is not None and not req.done:
                req.matcher.accept(token)

    def _advance_in_flight(self) -> None:
        if self._in_flight is not None and not self._advanced:
            rows, sampled = self._in_flight
            self._advance([req for req, _ in rows], sampled.tolist())
            self._advanced = True

    def _land(self) -> list[TokenEvent]:
        """The in-flight step's tokens, once on the host -> its events."""
        assert self._in_flight is not None
        self._advance_in_flight()
        (rows, sampled), self._in_flight = self._in_flight, None
        return self.sched.resolve(rows, sampled.tolist())

    def finish_step(self, plan: StepPlan, out: StepOutput) -> None:
        reqs = self.sched.sample_rows(plan)
        if reqs and not plan.overlap:  # penalties and sampling streams see the requests
            assert out.logits is not None  # as they were before this step's tokens
            if self.observe is not None:
                self.observe(out.logits)
            tokens = choose_tokens(out.logits, reqs, self.sched.eos_ids)
            logprobs = row_logprobs(out.logits, reqs, tokens)
        rows = self.sched.account(plan)
        # the previous step's tokens, if still in flight, come first (this step is queued
        # behind it on the device by now)
        events = self._land() if self._in_flight is not None else []
        if plan.overlap:
            assert out.sampled is not None
            self._in_flight, self._advanced = (rows, out.sampled), False
        elif rows:
            self._advance(reqs, tokens)
            events += self.sched.resolve(rows, tokens, logprobs)
        if self._failed:
            events = self._drop_failed(events)
        kv = self.runner.kv
        # pages only the prefix cache holds are evictable: reported apart, as SGLang does
        cached = [n * kv.page_size for n in kv.cached_pages]
        used = [kv.rank_pages[c] * kv.page_size if kv.cp_size > 1 else kv.used
                for c in range(kv.cp_size)]
        coords = [c if kv.cp_size > 1 else 0 for c in self._cp_coords]
        # tokens are on the host by now (with overlap: the previous step's)
        step_s = time.perf_counter() - out.started
        stats = {"kind": out.kind, "step_s": step_s, "running": len(self.sched.running),
                 "waiting": len(self.sched.waiting),
                 "kv_used": [used[c] - cached[c] for c in coords],
                 "kv_cached": [cached[c] for c in coords],
                 "preemptions": self.sched.preemptions,
                 "new_seqs": len(plan.extend),
                 "prefill_tokens": sum(len(ids) for _, ids, _ in plan.extend),
                 "cached_tokens": plan.cached_tokens}
        self.frontend.emit(events, stats)


def _argmax_row(req: Request) -> bool:
    """A row whose token is the argmax of its raw logits."""
    return req.params.greedy and not req.params.adjusts_logits


def _plain(req: Request) -> bool:
    """An argmax row of which nothing else is asked (no logprobs): its logits can stay on
    the device."""
    return _argmax_row(req) and req.logprobs is None


def engine_loop(runner: ModelRunner, driver: Driver | None) -> object:
    """Every rank: run rank 0's plans until it says stop -> the frontend's result.

    What exists when the loop starts (the model, its caches, the graphs: long-lived) is
    frozen out of Python's garbage collector while it runs: a full collection would walk
    it all, a pause of 0.1 s or more in some step (vLLM and SGLang freeze it likewise).
    A plan's profile command opens or closes a profiler window (`engine/profiler.py`)."""
    world = runner.groups.world
    sched = driver.sched if driver is not None else None
    profiler = StepProfiler(runner.groups.rank, runner.device)
    gc.freeze()
    try:
        for number in itertools.count():
            plan = comm.broadcast_object(driver.next_plan() if driver else None, world)
            assert isinstance(plan, StepPlan)
            profiler.apply(plan.profile)
            if plan.stop:
                return plan.result
            with profiler.step(number, plan.kind, counted=plan.kind != "idle"):
                out = run_step(runner, plan, sched, driver.masks if driver else None)
                if driver is not None:
                    driver.finish_step(plan, out)
    except BaseException:  # a failing rank: no device sync, no trace to write
        profiler.discard()
        raise
    finally:  # a rank pool runs the next task in this process: its objects are its own
        profiler.close()
        gc.unfreeze()


@dataclass
class BatchFrontend(Frontend):
    """A fixed batch of requests (`cpmoe generate`): all submitted at once; the loop stops
    when every one has finished. result(): the generated tokens of each request."""

    requests: list[Request]
    outputs: dict[int, list[int]] = field(default_factory=dict)
    _sent: bool = False
    _done: int = 0

    def poll(self, timeout: float) -> list[tuple]:
        if not self._sent:
            self._sent = True
            return [("add", r) for r in self.requests]
        return [("stop",)] if self._done == len(self.requests) else []

    def emit(self, events: list[TokenEvent], stats: dict) -> None:
        for ev in events:
            self.outputs.setdefault(ev.rid, []).append(ev.token)
            self._done += ev.finish is not None

    def result(self) -> list[list[int]]:
        return [self.outputs.get(r.rid, []) for r in self.requests]
