"""Server metrics and their Prometheus text exposition (format 0.0.4), written by hand.

All updates happen on the server's event loop thread, so no locking. Counters only grow;
gauges that describe the engine (KV slots per rank, running requests) are the values rank 0
reported with its latest step.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for upper, n in zip(self.buckets, self.counts or [0] * len(self.buckets)):
            running += n
            out.append(f'{name}_bucket{{le="{upper}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total:.6f}",
                f"{name}_count {self.count}"]
        return out


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)  # (endpoint, HTTP status) -> n
    finished: Counter = field(default_factory=Counter)  # finish reason -> n
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # taken from the prefix cache
    computed_prompt_tokens: int = 0  # prefilled (a preempted request's again)
    generation_tokens: int = 0
    steps: Counter = field(default_factory=Counter)  # step kind -> n
    step_seconds: Counter = field(default_factory=Counter)  # step kind -> seconds
    ttft: Histogram = field(default_factory=Histogram)
    intake: Histogram = field(default_factory=Histogram)  # arrival -> submitted to the engine
    itl: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    waiting: int = 0  # accepted, no token yet (the queue --max-queue bounds)
    running: int = 0
    kv_used: list[int] = field(default_factory=list)  # per rank, less kv_cached
    kv_cached: list[int] = field(default_factory=list)  # per rank: evictable prefix cache
    preemptions: int = 0
    kv_capacity: int = 0
    rank_pids: list[int] = field(default_factory=list)
    engine_up: bool = False

    def on_step(self, stats: dict) -> None:
        self.steps[stats["kind"]] += 1
        self.step_seconds[stats["kind"]] += stats["step_s"]
        self.running = stats["running"]
        self.kv_used = list(stats["kv_used"])
        self.kv_cached = list(stats.get("kv_cached", []))
        self.preemptions = stats["preemptions"]
        self.cached_prompt_tokens += stats.get("cached_tokens", 0)
        self.computed_prompt_tokens += stats.get("prefill_tokens", 0)

    def render(self) -> str:
        out: list[str] = []

        def family(name: str, kind: str, text: str, samples: list[str]) -> None:
            out.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples])

        family("cpmoe_requests_total", "counter", "HTTP generation requests by status",
               [f'cpmoe_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                for (e, s), n in sorted(self.requests.items())])
        family("cpmoe_requests_finished_total", "counter",
               "Accepted requests by how they ended",
               [f'cpmoe_requests_finished_total{{reason="{r}"}} {n}'
                for r, n in sorted(self.finished.items())])
        family("cpmoe_prompt_tokens_total", "counter", "Prompt tokens of accepted requests",
               [f"cpmoe_prompt_tokens_total {self.prompt_tokens}"])
        family("cpmoe_prompt_tokens_cached_total", "counter",
               "Prompt tokens taken from the prefix cache instead of prefilled",
               [f"cpmoe_prompt_tokens_cached_total {self.cached_prompt_tokens}"])
        family("cpmoe_prompt_tokens_computed_total", "counter",
               "Prompt tokens prefilled (again after a preemption)",
               [f"cpmoe_prompt_tokens_computed_total {self.computed_prompt_tokens}"])
        family("cpmoe_generation_tokens_total", "counter", "Tokens generated",
               [f"cpmoe_generation_tokens_total {self.generation_tokens}"])
        family("cpmoe_time_to_first_token_seconds", "histogram",
               "Arrival to first generated token", self.ttft.lines(
                   "cpmoe_time_to_first_token_seconds"))
        family("cpmoe_request_intake_seconds", "histogram",
               "Arrival to submitted to the engine (body read, parsed, tokenized)",
               self.intake.lines("cpmoe_request_intake_seconds"))
        family("cpmoe_inter_token_latency_seconds", "histogram",
               "Time between consecutive tokens of a request", self.itl.lines(
                   "cpmoe_inter_token_latency_seconds"))
        family("cpmoe_request_latency_seconds", "histogram", "Arrival to last token",
               self.e2e.lines("cpmoe_request_latency_seconds"))
        family("cpmoe_requests_waiting", "gauge", "Queue depth: accepted, not yet started",
               [f"cpmoe_requests_waiting {self.waiting}"])
        family("cpmoe_requests_running", "gauge", "Requests holding KV on the engine",
               [f"cpmoe_requests_running {self.running}"])
        family("cpmoe_kv_slots_used", "gauge",
               "KV cache slots in use, per rank (not counting the evictable prefix cache)",
               [f'cpmoe_kv_slots_used{{rank="{r}"}} {n}' for r, n in enumerate(self.kv_used)])
        family("cpmoe_kv_slots_cached", "gauge",
               "KV cache slots only the prefix cache holds (evicted when needed), per rank",
               [f'cpmoe_kv_slots_cached{{rank="{r}"}} {n}'
                for r, n in enumerate(self.kv_cached)])
        family("cpmoe_preemptions_total", "counter",
               "Running requests whose KV was freed to make room (re-prefilled later)",
               [f"cpmoe_preemptions_total {self.preemptions}"])
        family("cpmoe_kv_slots_capacity", "gauge", "KV cache slots per rank",
               [f"cpmoe_kv_slots_capacity {self.kv_capacity}"])
        family("cpmoe_engine_steps_total", "counter", "Engine steps by kind",
               [f'cpmoe_engine_steps_total{{kind="{k}"}} {n}'
                for k, n in sorted(self.steps.items())])
        family("cpmoe_engine_step_seconds_total", "counter", "Engine step time by kind",
               [f'cpmoe_engine_step_seconds_total{{kind="{k}"}} {s:.6f}'
                for k, s in sorted(self.step_seconds.items())])
        family("cpmoe_rank_pid", "gauge", "Process id of each engine rank",
               [f'cpmoe_rank_pid{{rank="{r}"}} {p}' for r, p in enumerate(self.rank_pids)])
        family("cpmoe_engine_up", "gauge", "1 while the engine ranks are alive",
               [f"cpmoe_engine_up {int(self.engine_up)}"])
        return "\n".join(out) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Exposition text -> {'name{labels}': value}; for tests and scripts."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


class BatchLog:
    """SGLang's batch log lines, on stderr, with a timestamp and the step's time added: one
    "Prefill batch." line per step that prefills (new sequences, new and cached prompt tokens)
    and one "Decode batch." line every `decode_interval` decode-only steps
    (`--decode-log-interval`, SGLang's flag; 0: none) with the generation throughput since
    the previous decode line. A server's steps read as a timeline in its log."""

    def __init__(self, decode_interval: int,
                 write: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.decode_interval = decode_interval
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock = clock
        self._decodes = 0
        self._tokens = 0  # generated since the last decode line
        self._since = clock()

    def on_step(self, stats: dict, tokens: int, kv_capacity: int) -> None:
        """`tokens`: the step's generated tokens (events)."""
        self._tokens += tokens
        used = stats["kv_used"]
        usage = sum(used) / (kv_capacity * len(used)) if kv_capacity and used else 0.0
        queue = f"#running-req: {stats['running']}, #queue-req: {stats['waiting']}"
        step = f"step: {stats['step_s'] * 1e3:.1f} ms"
        if stats.get("prefill_tokens"):
            self._emit(f"Prefill batch. #new-seq: {stats['new_seqs']}, "
                       f"#new-token: {stats['prefill_tokens']}, "
                       f"#cached-token: {stats['cached_tokens']}, token usage: {usage:.2f}, "
                       f"{queue}, {step}")
        elif stats["kind"] == "decode" and self.decode_interval > 0:
            self._decodes += 1
            if self._decodes % self.decode_interval == 0:
                now = self.clock()
                rate = self._tokens / max(now - self._since, 1e-9)
                self._emit(f"Decode batch. #running-req: {stats['running']}, "
                           f"token usage: {usage:.2f}, gen throughput (token/s): {rate:.1f}, "
                           f"#queue-req: {stats['waiting']}, {step}")
                self._tokens, self._since = 0, now

    def _emit(self, text: str) -> None:
        self.write(f"[{datetime.now().strftime('%H:%M:%S.%f')[:-3]}] {text}")
