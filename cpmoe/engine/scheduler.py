"""Continuous batching on rank 0: what every rank runs in the next step.

A step (`StepPlan`) frees finished sequences, runs one extend forward (prompt chunks of one
or more requests, CP-split) and one decode forward (one token for every running request that
has finished its prompt). Decode streams therefore keep producing tokens while a long prompt
is prefilled chunk by chunk (`--chunked-prefill-size` tokens per step).

Memory is accounted in KV pages of every CP rank, read off rank 0's own cache (which mirrors
every rank's page use, see cp/kv_cache.py):
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

Prefix cache (radix=True; `--disable-radix-cache` turns it off): a request's prompt is
looked up in a `RadixIndex` of the sequences in the cache (running requests' prompts once
prefilled, finished requests' prompt + answer); the longest shared prefix, up to all but the
last token of the prompt (that token's logits are needed), is forked from the entry that
holds it (`PagedKVCache.fork`, on every rank at the start of the step) and only the rest is
prefilled, as chunks that attend the cached prefix. `cached_tokens` is that length, exact to
the token (no rounding to pages: a partly covered page is copied). A finished (or cancelled)
request's sequence stays in the cache as an index entry instead of being freed. Pages are
reference counted; when a step's pages do not fit, finished entries are evicted in LRU order
(their pages no running request shares return) before any request is preempted.
A waiting request that shares at least `DEFER_SHARED` more tokens with a prompt still being
prefilled (admitted, not yet in the index) than the index gives it waits until that prompt
is in the index, then forks it, as SGLang's in-batch prefix check does: a burst of
requests over one system prompt then prefills the prompt once, not once per request.
Requests behind it are still admitted (no head-of-line blocking).
`--schedule-policy lpm` (SGLang's longest prefix match): each step, before admitting, the
waiting queue is ordered by the prefix each request finds in the index, longest first
(arrival order among equals), while it holds at most `LPM_MAX_WAITING` requests (SGLang's
fallback to FCFS: a longer queue is not scanned every step). A burst over a few system
prompts then prefills, right after each prompt, the questions that share it, instead of the
next prompts in arrival order; `fcfs` (the default, as SGLang's) keeps arrival order.

Overlap (the driver's `--disable-overlap-schedule` off): a step's sampled tokens may reach
the host only after the next step was planned and launched. `account` then gives each
sampled row a placeholder token `-(i + 1)` (row i of that step's tokens, which the runner
keeps on the device and feeds to the next decode), and `resolve` writes the real tokens once
they are on the host. A request whose placeholder turns out to be EOS has run one extra
decode row by then: its output is cut at EOS and the row's token is dropped. Only requests
that may finish by EOS run such a row: one that reaches max_tokens is known to finish by
the count and is not decoded again.

Pure bookkeeping over the cache's accounting (no forward, no collective): testable alone.
"""

from __future__ import annotations

from collections import deque

from cpmoe.cp.kv_cache import PagedKVCache, PageRelease
from cpmoe.cp.split import balancing_rotation, rank_counts
from cpmoe.engine.radix import RadixIndex
from cpmoe.engine.request import Request, StepPlan, TokenEvent

DEFER_SHARED = 32  # tokens (SGLang's in-batch prefix-caching threshold)
SCHEDULE_POLICIES = ("fcfs", "lpm")  # --schedule-policy
LPM_MAX_WAITING = 128  # SGLang's: longer queues are admitted in arrival order


class Scheduler:
    def __init__(self, kv: PagedKVCache, strategy: str, chunk_size: int, max_running: int,
                 eos_ids: tuple[int, ...], radix: bool = False, policy: str = "fcfs"
                 ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule policy must be one of {SCHEDULE_POLICIES}, got "
                             f"{policy!r}")
        self.kv, self.strategy, self.policy = kv, strategy, policy
        # the prefix cache needs the paged cache's page lists (not a model's own cache)
        self.index = (RadixIndex(kv.page_size) if radix and isinstance(kv, PagedKVCache)
                      else None)
        # prompts admitted but not yet in `index` (being prefilled), to defer their sharers
        self.inflight = RadixIndex(kv.page_size) if self.index is not None else None
        self.chunk_size = chunk_size if chunk_size > 0 else None  # None: no chunking
        # a model's own cache has a fixed number of sequence slots (DeepSeek-V4's
        # `max_seqs`): admission stops there, a request never meets a full slot table
        self.max_running = min(max_running, getattr(kv, "max_seqs", max_running))
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # admitted, in admission order
        self.preemptions = 0
        self.evictions = 0  # prefix-cache entries freed for room
        self._to_free: list[int] = []
        self._to_cache: list[int] = []
        self._admissions = 0

    # ---- requests in and out ----------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self.index is not None and req.rid in self.index.lru:  # a reused id: drop its entry
            self.index.remove(req.rid)
            self._to_free.append(req.rid)
        self.waiting.append(req)

    def cancel(self, rid: int) -> None:
        """Drop a request wherever it is; unknown ids (already finished) are ignored."""
        if rid in self.running:
            req = self.running.pop(rid)
            req.done = True
            self._drop(req)
            return
        for req in self.waiting:
            if req.rid == rid:
                req.done = True
                self.waiting.remove(req)
                return

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_free or self._to_cache)

    def take_frees(self) -> list[int]:
        """Ids whose KV the next step must free (for a last, free-only step)."""
        frees, self._to_free = self._to_free, []
        return frees

    def _drop(self, req: Request) -> None:
        """A request that left: its KV stays as a prefix-cache entry, or is freed."""
        if self.inflight is not None:
            self.inflight.remove(req.rid)
        if not req.cached:
            return
        if self.index is not None:
            self.index.insert(req.rid, req.tokens[:req.cached], evictable=True)
            self._to_cache.append(req.rid)
        else:
            self._to_free.append(req.rid)

    def clear_cache(self) -> None:
        """Free every finished entry of the prefix cache (at the next step)."""
        if self.index is not None:
            for key in self.index.evictable():
                self.index.remove(key)
                self._to_free.append(key)
            self._to_cache = []

    # ---- planning -----------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        cache, self._to_cache = self._to_cache, []
        step = _StepPages(self.kv, self.take_frees())
        decode = [r for r in self.running.values() if r.decoding]
        need = self.kv.decode_pages_needed([r.rid for r in decode])
        preempted = False
        while decode and any(n > a for n, a in zip(need, step.avail)):
            if self._evict(step):
                continue
            victim = max(decode, key=lambda r: r.admitted)
            decode.remove(victim)
            self._preempt(victim, step)
            need = self.kv.decode_pages_needed([r.rid for r in decode])
            preempted = True
        step.avail = [a - n for a, n in zip(step.avail, need)]
        # after a preemption nothing new is admitted this step: it would take the freed
        # pages and force the next preemption
        extend = self._extend_segments(step, admit=not preempted)
        freed = set(step.free)
        scored = [rid for rid, _, _ in extend if self.running[rid].prompt_logprobs is not None
                  and not self.running[rid].output]
        return StepPlan(free=step.free, cache=[k for k in cache if k not in freed],
                        fork=step.forks, extend=extend,
                        extend_ends=[len(self.running[rid].tokens) for rid, _, _ in extend],
                        decode=[(r.rid, r.last_token) for r in decode], prompt_logits=scored)

    def _evict(self, step: "_StepPages") -> bool:
        """Free the least recently used finished entry this step does not fork from."""
        if self.index is None:
            return False
        key = next((k for k in self.index.lru if k not in step.pinned), None)
        if key is None:
            return False
        self.index.remove(key)
        step.add_free(key)
        self.evictions += 1
        return True

    def _preempt(self, req: Request, step: "_StepPages") -> None:
        if self.index is not None:
            self.index.remove(req.rid)
            self.inflight.remove(req.rid)
        step.add_free(req.rid)
        del self.running[req.rid]
        req.cached = 0
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _match(self, req: Request) -> tuple[int | None, int]:
        """The cache entry holding the longest prefix of the request's tokens, and its
        length, up to all but the last token (whose logits the step must compute)."""
        if self.index is None or req.prompt_logprobs is not None:  # every row is scored
            return None, 0
        key, n = self.index.match(req.tokens)
        n = min(n, len(req.tokens) - 1)
        if key is None or n <= 0 or not self.kv.can_fork(key):
            return None, 0
        return key, n

    def _extend_segments(self, step: "_StepPages", admit: bool
                         ) -> list[tuple[int, list[int], int]]:
        budget = self.chunk_size or float("inf")
        out: list[tuple[int, list[int], int]] = []
        partial = next((r for r in self.running.values() if r.prefilling),
                       None)
        if partial is not None:  # the prompt being chunked goes first, alone if it must
            n = int(min(partial.pending, budget))
            if not self._take(partial, n, step, out):
                return out  # wait for pages; admit nothing new meanwhile
            budget -= n
            if partial.pending > n:
                return out
        if admit and self.policy == "lpm":
            self._order_by_prefix()
        skipped: list[Request] = []
        while (admit and self.waiting and budget > 0
               and len(self.running) < self.max_running):
            req = self.waiting.popleft()
            src, hit = self._match(req)
            if self._shares_inflight(req, hit):
                skipped.append(req)
                continue
            n = req.pending - hit
            if n > budget:
                if out:  # room for a whole prompt next step rather than a sliver now
                    skipped.append(req)
                    break
                n = int(budget)
            if self._take(req, n, step, out, src, hit):
                self._admissions += 1
                req.admitted = self._admissions
                req.cached_prompt = min(hit, len(req.prompt))
                self.running[req.rid] = req
                if self.inflight is not None and req.cached < len(req.prompt):
                    self.inflight.insert(req.rid, req.prompt)
                budget -= n
                if req.pending > n:
                    break  # chunked: the rest of it goes first in the next steps
            else:
                skipped.append(req)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _order_by_prefix(self) -> None:
        """LPM: the waiting queue, longest indexed prefix first (stable)."""
        if self.index is None or not 1 < len(self.waiting) <= LPM_MAX_WAITING:
            return
        hits = {id(r): self.index.match(r.tokens)[1] for r in self.waiting}
        self.waiting = deque(sorted(self.waiting, key=lambda r: -hits[id(r)]))

    def _shares_inflight(self, req: Request, hit: int) -> bool:
        """Whether `req` should wait for a prompt being prefilled that holds DEFER_SHARED
        more of its tokens than the index does (a waiting request holds no cache)."""
        if self.inflight is None or req.prompt_logprobs is not None:
            return False
        _, shared = self.inflight.match(req.tokens)
        return min(shared, len(req.tokens) - 1) - hit >= DEFER_SHARED

    def _take(self, req: Request, n: int, step: "_StepPages",
              out: list[tuple[int, list[int], int]], src: int | None = None, hit: int = 0
              ) -> bool:
        """Add n of the request's pending tokens (after `hit` tokens forked from entry
        `src`) to the step if their pages fit, evicting finished entries if they must."""
        kv = self.kv
        if src is not None:
            counts = kv.fork_counts(src, hit)
            need = kv.fork_pages_needed(src, hit)
        else:
            counts = kv.seqs[req.rid].counts if req.cached else [0] * kv.cp_size
            need = [0] * kv.cp_size
        rot = balancing_rotation(counts, n, self.strategy)
        grow = kv.pages_to_grow(counts, rank_counts(n, kv.cp_size, self.strategy, rot))
        need = [a + b for a, b in zip(need, grow)]
        if src is not None:
            step.pinned.add(src)
        while any(nd > lf for nd, lf in zip(need, step.avail)):
            if not self._evict(step):
                return False
        for r, nd in enumerate(need):
            step.avail[r] -= nd
        if src is not None:
            step.forks.append((req.rid, src, hit))
            req.cached = hit
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
        """After the step ran: `account` it and `resolve` its tokens at once (one token and
        its (logprob, top) or None per `sample_rows` row)."""
        return self.resolve(self.account(plan), tokens, logprobs)

    def account(self, plan: StepPlan) -> list[tuple[Request, int]]:
        """After the step ran: count its tokens as cached and give each sampled row a
        placeholder token -> (request, index of the placeholder in its output) per row."""
        rows = self.sample_rows(plan)
        for rid, _ in plan.decode:
            self.running[rid].cached += 1
        for rid, ids, _ in plan.extend:
            req = self.running[rid]
            req.cached += len(ids)
            if self.index is not None and req.pending == 0:  # a prefilled prompt: shareable
                self.index.insert(rid, req.tokens[:req.cached])
                self.inflight.remove(rid)
        out = []
        for i, req in enumerate(rows):
            req.output.append(-(i + 1))
            out.append((req, len(req.output) - 1))
        return out

    def resolve(self, rows: list[tuple[Request, int]], tokens: list[int],
                logprobs: list[tuple[float, tuple] | None] | None = None) -> list[TokenEvent]:
        """The real tokens of `account`'s rows: finished requests leave `running` (or
        `waiting`, if preempted meanwhile) -> one event per row of a request still alive."""
        events = []
        logprobs = logprobs or [None] * len(rows)
        for (req, at), token, lp in zip(rows, tokens, logprobs, strict=True):
            if req.done:  # finished by EOS a step earlier, or cancelled
                continue
            req.output[at] = token
            stop = (token in self.eos_ids and req.ends_on_eos) or token in req.stop_ids
            finish = ("stop" if stop else "length" if at + 1 >= req.max_tokens else None)
            if finish is not None:
                self._finish(req, at)
            cached = req.cached_prompt if finish is not None else None
            prompt = (tuple(req.prompt_lps) if at == 0 and req.prompt_logprobs is not None
                      else None)
            events.append(TokenEvent(req.rid, token, finish, None if lp is None else lp[0],
                                     None if lp is None else lp[1], cached, prompt))
        return events

    def _finish(self, req: Request, at: int) -> None:
        """The request ended with output[at]: tokens in flight after it are dropped."""
        req.done = True
        del req.output[at + 1:]
        if self.running.get(req.rid) is req:
            del self.running[req.rid]
            self._drop(req)
        else:  # preempted while its last token was in flight
            self.waiting = deque(r for r in self.waiting if r is not req)


class _StepPages:
    """The pages of every CP rank a step being planned can still use: free pages plus what
    its frees return (shared pages count only once no sequence references them)."""

    def __init__(self, kv: PagedKVCache, free: list[int]) -> None:
        self.free: list[int] = []
        self.forks: list[tuple[int, int, int]] = []
        self.pinned: set[int] = set()  # entries this step forks from: never evicted by it
        self._release = PageRelease(kv)
        self.avail = [kv.free_pages(r) for r in range(kv.cp_size)]
        for key in free:
            self.add_free(key)

    def add_free(self, key: int) -> None:
        self.free.append(key)
        self.avail = [a + n for a, n in zip(self.avail, self._release.add(key))]
