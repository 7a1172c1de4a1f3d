"""Continuous batching on rank 0: what every rank runs in the next step.

A step (`StepPlan`) frees finished sequences, runs one extend forward (prompt chunks of one
or more requests, CP-split) and one decode forward (one token for every running request that
has finished its prompt). Decode streams therefore keep producing tokens while a long prompt
is prefilled chunk by chunk (`--chunked-prefill-size` tokens per step).

Memory is accounted in KV pages of every CP rank, read off rank 0's own cache (which mirrors
every rank's page use, see kv_cache.py):
- a decode step needs a page on a sequence's owner rank when its shard there is page-aligned;
  if some rank lacks them, the newest decoding requests are preempted (their pages freed, the
  request queued again at the front with its tokens so far, re-prefilled later and continued
  from where it was: the sampling stream is indexed by tokens generated, so its tokens do not
  change);
- a prompt chunk is admitted only if its pages fit next to the next decode step's needs;
  waiting requests that do not fit yet are skipped, so small requests are not blocked behind
  a large one; while one prompt is being chunked, nothing new is admitted (it cannot starve);
- a request that cannot fit even alone is refused before it reaches the engine
  (`kv_cache.request_rank_tokens`).

Pure bookkeeping over the cache's accounting (no forward, no collective): testable alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cpmoe.engine.kv_cache import PagedKVCache
from cpmoe.engine.sampling import SamplingParams


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stream: int = 0  # sampling stream: the prompt index of a generate batch, 0 when served
    ignore_eos: bool = False  # run to max_tokens (load tests, benchmarks)
    kv_need: int = 0  # KV slots on the busiest CP rank at its longest (reported, not used)
    logprobs: int | None = None  # None: none; k: the token's log-probability and the top k
    output: list[int] = field(default_factory=list)
    cached: int = 0  # tokens of prompt + output held in the KV cache
    admitted: int = 0  # admission order (preemption takes the newest)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (1 while decoding: the last sampled token)."""
        return len(self.prompt) + len(self.output) - self.cached

    @property
    def decoding(self) -> bool:
        """Only the last sampled token is pending (a prompt chunked so that one prompt token
        is left still extends)."""
        return self.pending == 1 and self.cached >= len(self.prompt)

    @property
    def generated(self) -> int:
        return len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1]


@dataclass(frozen=True)
class StepPlan:
    """What every rank does in one step; built on rank 0 and broadcast to all ranks."""

    free: list[int] = field(default_factory=list)  # request ids whose KV to free first
    extend: list[tuple[int, list[int], int]] = field(default_factory=list)  # (id, ids, start)
    decode: list[tuple[int, int]] = field(default_factory=list)  # (id, token to feed)
    stop: bool = False  # leave the engine loop
    result: object = None  # with stop: what the loop returns on every rank

    @property
    def empty(self) -> bool:
        return not (self.free or self.extend or self.decode)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of a request; `finish` is "stop" (EOS), "length" or None.
    With `Request.logprobs`: the token's log-probability and the top (token, logprob)."""

    rid: int
    token: int
    finish: str | None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None


class Scheduler:
    def __init__(self, kv: PagedKVCache, strategy: str, chunk_size: int, max_running: int,
                 eos_ids: tuple[int, ...]) -> None:
        self.kv, self.strategy = kv, strategy
        self.chunk_size = chunk_size if chunk_size > 0 else None  # None: no chunking
        self.max_running = max_running
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # admitted, in admission order
        self.preemptions = 0
        self._to_free: list[int] = []
        self._admissions = 0

    # ---- requests in and out ----------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def cancel(self, rid: int) -> None:
        """Drop a request wherever it is; unknown ids (already finished) are ignored."""
        if rid in self.running:
            self._drop(self.running.pop(rid))
            return
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_free)

    def take_frees(self) -> list[int]:
        """Ids whose KV the next step must free (for a last, free-only step)."""
        frees, self._to_free = self._to_free, []
        return frees

    def _drop(self, req: Request) -> None:
        if req.cached:
            self._to_free.append(req.rid)

    # ---- planning -----------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        free = self.take_frees()
        avail = self._available(free)
        decode = [r for r in self.running.values() if r.decoding]
        need = self.kv.decode_pages_needed([r.rid for r in decode])
        preempted = False
        while decode and any(n > a for n, a in zip(need, avail)):
            victim = max(decode, key=lambda r: r.admitted)
            decode.remove(victim)
            self._preempt(victim, free, avail)
            need = self.kv.decode_pages_needed([r.rid for r in decode])
            preempted = True
        left = [a - n for a, n in zip(avail, need)]
        # after a preemption nothing new is admitted this step: it would take the freed
        # pages and force the next preemption
        extend = self._extend_segments(left, admit=not preempted)
        return StepPlan(free=free, extend=extend,
                        decode=[(r.rid, r.last_token) for r in decode])

    def _available(self, free: list[int]) -> list[int]:
        """Free pages of every CP rank once this step's frees ran."""
        avail = [self.kv.free_pages(r) for r in range(self.kv.cp_size)]
        for rid in free:
            for r, n in enumerate(self.kv.pages_held(rid)):
                avail[r] += n
        return avail

    def _preempt(self, req: Request, free: list[int], avail: list[int]) -> None:
        for r, n in enumerate(self.kv.pages_held(req.rid)):
            avail[r] += n
        free.append(req.rid)
        del self.running[req.rid]
        req.cached = 0
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _extend_segments(self, left: list[int], admit: bool
                         ) -> list[tuple[int, list[int], int]]:
        budget = self.chunk_size or float("inf")
        out: list[tuple[int, list[int], int]] = []
        partial = next((r for r in self.running.values() if not r.decoding),
                       None)
        if partial is not None:  # the prompt being chunked goes first, alone if it must
            n = int(min(partial.pending, budget))
            if not self._take(partial, n, left, out):
                return out  # wait for pages; admit nothing new meanwhile
            budget -= n
            if partial.pending > n:
                return out
        skipped: list[Request] = []
        while (admit and self.waiting and budget > 0
               and len(self.running) < self.max_running):
            req = self.waiting.popleft()
            n = req.pending
            if n > budget:
                if out:  # room for a whole prompt next step rather than a sliver now
                    skipped.append(req)
                    break
                n = int(budget)
            if self._take(req, n, left, out):
                self._admissions += 1
                req.admitted = self._admissions
                self.running[req.rid] = req
                budget -= n
                if req.pending > n:
                    break  # chunked: the rest of it goes first in the next steps
            else:
                skipped.append(req)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _take(self, req: Request, n: int, left: list[int],
              out: list[tuple[int, list[int], int]]) -> bool:
        """Add n of the request's pending tokens to the step if their pages fit `left`."""
        key = req.rid if req.cached else None
        need = self.kv.extend_pages_needed(key, self.kv.new_counts(key, n, self.strategy))
        if any(nd > lf for nd, lf in zip(need, left)):
            return False
        for r, nd in enumerate(need):
            left[r] -= nd
        out.append((req.rid, req.tokens[req.cached:req.cached + n], req.cached))
        return True

    # ---- results ------------------------------------------------------------------------------
    def sample_rows(self, plan: StepPlan) -> list[Request]:
        """Requests that get a token this step, in the order of the step's logits rows:
        decode rows, then extend segments that complete their request's pending tokens."""
        rows = [self.running[rid] for rid, _ in plan.decode]
        for rid, ids, start in plan.extend:
            req = self.running[rid]
            if start + len(ids) == len(req.tokens):
                rows.append(req)
        return rows

    def record(self, plan: StepPlan, tokens: list[int],
               logprobs: list[tuple[float, tuple] | None] | None = None) -> list[TokenEvent]:
        """After the step ran: account the cached tokens, take each sampled token (one per
        `sample_rows` row, with its (logprob, top) or None); finished requests leave
        `running`."""
        rows = self.sample_rows(plan)
        for rid, _ in plan.decode:
            self.running[rid].cached += 1
        for rid, ids, _ in plan.extend:
            self.running[rid].cached += len(ids)
        events = []
        logprobs = logprobs or [None] * len(rows)
        for req, token, lp in zip(rows, tokens, logprobs, strict=True):
            req.output.append(token)
            eos = token in self.eos_ids and not req.ignore_eos
            finish = ("stop" if eos else "length" if req.generated >= req.max_tokens else None)
            if finish is not None:
                del self.running[req.rid]
                self._drop(req)
            events.append(TokenEvent(req.rid, token, finish) if lp is None else
                          TokenEvent(req.rid, token, finish, lp[0], lp[1]))
        return events
