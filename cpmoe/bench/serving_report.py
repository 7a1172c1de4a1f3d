"""What `cpmoe bench-serving` reports: one request's `Outcome`, the run's summary (throughput,
TTFT / ITL / TPOT / latency percentiles, prefix hit rate), the interference a long prompt
causes on the streams decoding beside it, the printed table and the optional plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from cpmoe.bench import report as rp


@dataclass
class Outcome:
    prompt_len: int
    output_len: int  # asked
    ok: bool = False
    error: str = ""
    tokens: int = 0  # produced (usage.completion_tokens)
    cached: int = 0  # prompt tokens from the server's prefix cache (usage)
    ttft: float = 0.0
    sent: float = 0.0  # from the start to the request body written to the socket
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    values = sorted(values)

    def pct(q: float) -> float:
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]

    return {"mean": statistics.fmean(values), "p50": pct(0.5), "p90": pct(0.9),
            "p99": pct(0.99)}


def summarize(results: list[Outcome], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    inputs, cached = sum(r.prompt_len for r in ok), sum(r.cached for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            "duration_s": wall, "request_throughput": len(ok) / wall,
            "input_token_throughput": sum(r.prompt_len for r in ok) / wall,
            "output_token_throughput": out_tokens / wall,
            "total_input_tokens": sum(r.prompt_len for r in ok),
            "total_output_tokens": out_tokens,
            "total_cached_tokens": cached,
            "prefix_hit_rate": cached / inputs if inputs else 0.0,
            "ttft_s": _stats([r.ttft for r in ok]),
            # the client's own share of TTFT: until the request was on the wire
            "send_s": _stats([r.sent for r in ok]),
            "itl_s": _stats([x for r in ok for x in r.itl]),
            "tpot_s": _stats(tpot), "e2e_latency_s": _stats([r.latency for r in ok])}


def interference(results: list[Outcome], long: dict, chunk: int) -> dict:
    """The streams' inter-token gaps while the long prompt was prefilled, against the time
    one step of that prefill took (its TTFT over its chunks: a chunk plus the decode step
    that rides with it)."""
    inside, outside = [], []
    for r in results:
        for a, b in zip(r.chunk_times, r.chunk_times[1:]):
            (inside if long["sent"] <= b and a <= long["done"] else outside).append(b - a)
    chunks = -(-long["prompt_len"] // chunk) if chunk > 0 else 1
    step = long["ttft_s"] / chunks if not long["error"] else None
    p99 = _stats(inside)["p99"]
    return {**{k: v for k, v in long.items() if k not in ("sent", "done")},
            "chunks": chunks, "step_s": step, "itl_during_s": _stats(inside),
            "itl_outside_s": _stats(outside),
            "p99_itl_vs_2x_step": p99 / (2 * step) if p99 and step else None}


def long_line(lp: dict) -> str:
    if lp["error"]:
        return f"long prompt of {lp['prompt_len']} tokens: FAILED: {lp['error']}"
    return (f"long prompt of {lp['prompt_len']} tokens: TTFT {lp['ttft_s']:.2f} s over "
            f"{lp['chunks']} chunks ({lp['step_s'] * 1e3:.1f} ms a step); streams' ITL "
            f"meanwhile p99 {(lp['itl_during_s']['p99'] or 0) * 1e3:.1f} ms = "
            f"{lp['p99_itl_vs_2x_step'] or 0:.2f} x (2 steps)")


def _ttft_line(s: dict) -> str:
    """Where the client's TTFT went: its own sending, the server's intake, the server."""
    return (f"TTFT mean {s['ttft_s']['mean'] * 1e3:.1f} ms here: request on the wire after "
            f"{s['send_s']['mean'] * 1e3:.1f} ms; the server's own TTFT "
            f"{s['server_ttft_s'] * 1e3:.1f} ms, of it intake (body, parse, tokenize) "
            f"{(s['server_intake_s'] or 0) * 1e3:.1f} ms")


def report(s: dict) -> str:
    def row(name: str, st: dict, scale: float = 1e3) -> str:
        vals = [st[k] for k in ("mean", "p50", "p90", "p99")]
        return f"| {name} | " + " | ".join("-" if v is None else f"{v * scale:.1f}"
                                           for v in vals) + " |"

    lines = [f"completed {s['completed']}, failed {s['failed']} in {s['duration_s']:.1f} s",
             *([long_line(s["long_prompt"])] if s.get("long_prompt") else []),
             f"request throughput {s['request_throughput']:.2f} req/s, input "
             f"{s['input_token_throughput']:,.0f} tok/s, output "
             f"{s['output_token_throughput']:,.0f} tok/s",
             f"prefix cache: {s.get('total_cached_tokens', 0):,} of "
             f"{s.get('total_input_tokens', 0):,} prompt tokens cached (hit rate "
             f"{s.get('prefix_hit_rate', 0.0):.1%})",
             *([_ttft_line(s)] if s.get("server_ttft_s") is not None
               and s["ttft_s"]["mean"] is not None else []),
             "| ms | mean | p50 | p90 | p99 |", "|---|---|---|---|---|",
             row("TTFT", s["ttft_s"]), row("ITL", s["itl_s"]), row("TPOT", s["tpot_s"]),
             row("E2E", s["e2e_latency_s"])]
    return "\n".join(lines)


def plot(results: list[Outcome], path: Path) -> str | None:
    plt = rp.pyplot()
    if plt is None:
        return rp.NO_MATPLOTLIB
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].hist([r.ttft * 1e3 for r in ok], bins=40)
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].hist([x * 1e3 for r in ok for x in r.itl], bins=60)
    axes[1].set_xlabel("ITL (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
