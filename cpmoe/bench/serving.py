"""`cpmoe bench-serving`: online serving throughput and latency over real HTTP streaming,
after `sglang.bench_serving`.

Against `--base-url` or a server it starts itself (`--launch` followed by `cpmoe serve`
flags; its port is chosen at run time and it is stopped at the end). Requests go to
`/v1/completions` as token-id prompts with `stream: true`, `ignore_eos: true` and
`max_tokens` = the request's output length, so every request produces exactly its tokens;
`--max-concurrency` caps requests in flight, `--request-rate` (requests/s, Poisson) paces
arrivals (default: all at once). `--json-schema FILE`: every request also asks for output
matching that JSON schema (`response_format` json_schema, structured output); a request
then ends when its JSON is complete, so it counts as done with at most its output length.

Datasets: `random` (input lengths uniform in [ratio * L, L], random token ids; outputs
likewise) and `shared-prefix` (GSM8K-like by default: one 700-token few-shot prefix shared
by every prompt, then ~100 tokens of its own, ~200 output tokens; `--gsp-*` set the sizes
and the number of distinct prefixes, after SGLang's generated-shared-prefix dataset).

The prefix cache's hit rate is reported: prompt tokens the server took from its cache
(`usage.prompt_tokens_details.cached_tokens`) over all prompt tokens.

Reported (mean, p50, p90, p99): TTFT (request started -> first token), ITL (between
streamed chunks after the first), TPOT ((latency - TTFT) / (output tokens - 1)) and
end-to-end latency; request, input and output token throughput over the run's wall time.
Where TTFT goes: the client's part (started -> request body on the wire, `send_s`) and,
from the server's /metrics after the run, its own TTFT (arrival -> first token) and the
intake within it (body read, parsed, tokenized). Each request has its own connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import ssl
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cpmoe.bench import report as rp
from cpmoe.bench.provenance import provenance
from cpmoe.bench.spec import BenchError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="a running server, e.g. "
                   "http://127.0.0.1:8000 (else --launch)")
    p.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths drawn uniformly in [ratio * len, len]")
    p.add_argument("--gsp-system-prompt-len", type=int, default=700,
                   help="shared-prefix: tokens of each shared prefix")
    p.add_argument("--gsp-question-len", type=int, default=100,
                   help="shared-prefix: tokens after the prefix (uniform in +-20%%)")
    p.add_argument("--gsp-output-len", type=int, default=200,
                   help="shared-prefix: output tokens (uniform in +-10%%)")
    p.add_argument("--gsp-num-groups", type=int, default=1,
                   help="shared-prefix: distinct prefixes; request i uses prefix i mod this")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: all)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: all at once)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below it (default: the launched model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help="a JSON schema every request's output must match (structured output)")
    p.add_argument("--out", type=Path, required=True, help="JSON file of the results")
    p.add_argument("--plot", action="store_true", help="PNG of the latencies next to --out")
    p.add_argument("--long-prompt-len", type=int, default=None,
                   help="also send one prompt of this many tokens (max_tokens 1) once every "
                        "other request has its first token, and report the others' ITL "
                        "while it is prefilled")
    p.add_argument("--profile", action="store_true",
                   help="torch-profile the server's steps during the load (POST "
                        "/start_profile before it, /stop_profile after); the ranks write "
                        "their traces to $CPMOE_TORCH_PROFILER_DIR (default "
                        "/tmp/cpmoe-profile) on the server's machine")
    p.add_argument("--profile-num-steps", type=int, default=None,
                   help="with --profile: only the load's first N engine steps")
    p.add_argument("--launch", nargs=argparse.REMAINDER, default=None,
                   help="start `cpmoe serve` with the flags that follow (must come last)")


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


def make_requests(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    if args.dataset == "shared-prefix":
        q, o = args.gsp_question_len, args.gsp_output_len
        prefixes = [[rng.randrange(vocab) for _ in range(args.gsp_system_prompt_len)]
                    for _ in range(args.gsp_num_groups)]
        return [(prefixes[i % len(prefixes)] + [rng.randrange(vocab) for _ in range(
                 rng.randint(int(0.8 * q), int(1.2 * q)))],
                 max(1, rng.randint(int(0.9 * o), int(1.1 * o))))
                for i in range(args.num_prompts)]

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * args.random_range_ratio)), n)

    return [([rng.randrange(vocab) for _ in range(length(args.random_input_len))],
             length(args.random_output_len)) for _ in range(args.num_prompts)]


def read_json_schema(path: Path | None) -> dict | None:
    """--json-schema FILE -> the `response_format` requests carry (None without it)."""
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"--json-schema {path}: not a readable JSON file ({e})") from None
    if not isinstance(schema, dict):
        raise BenchError(f"--json-schema {path}: expected a JSON schema object, got "
                         f"{type(schema).__name__}")
    return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema,
                                                   "strict": True}}


async def _one(connect, url: str, model: str, prompt: list[int], out_len: int,
               response_format: dict | None = None) -> Outcome:
    """One streamed completion on its own connection (`connect()`: a new client); with
    `response_format` its grammar may end it before out_len tokens."""
    res = Outcome(len(prompt), out_len)
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if response_format is not None:
        body["response_format"] = response_format
    start = last = time.perf_counter()

    async def trace(event: str, info: dict) -> None:  # httpcore's connection events
        if event.endswith("send_request_body.complete"):
            res.sent = time.perf_counter() - start

    try:
        async with connect() as client, client.stream(
                "POST", f"{url}/v1/completions", json=body,
                extensions={"trace": trace}) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    res.cached = details.get("cached_tokens") or 0
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                res.chunk_times.append(now)
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = (res.tokens == out_len if response_format is None
                  else 0 < res.tokens <= out_len)
        if not res.ok:
            res.error = f"{res.tokens} tokens, asked {out_len}"
    except Exception as e:  # noqa: BLE001 -- a failed request is a result
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, requests: list[tuple[list[int], int]],
                   concurrency: int | None, rate: float, seed: int,
                   long_prompt: list[int] | None = None, response_format: dict | None = None
                   ) -> tuple[list[Outcome], float, dict | None]:
    import httpx
    from tqdm import tqdm
    limit = asyncio.Semaphore(concurrency or len(requests))
    rng = random.Random(seed + 1)
    bar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)

    # A client (connection) per request, as sglang.bench_serving opens a session per
    # request: one shared httpx pool reusing idle keep-alive connections put a burst of 128
    # requests on the wire over seconds (encode/httpx#3215), which the run counted as TTFT.
    # The clients share one SSL context: building one per client costs ~20 ms.
    timeout = httpx.Timeout(3600.0, connect=60.0)
    ssl_context = ssl.create_default_context()

    def connect() -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout, verify=ssl_context)

    async def guarded(prompt, out_len) -> Outcome:
        async with limit:
            res = await _one(connect, url, model, prompt, out_len, response_format)
        bar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for prompt, out_len in requests:
        tasks.append(asyncio.create_task(guarded(prompt, out_len)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    long = None
    if long_prompt is not None:
        long = await _interfere(connect, url, model, long_prompt, tasks)
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    bar.close()
    return list(results), wall, long


async def _interfere(connect, url: str, model: str, prompt: list[int], tasks) -> dict:
    """Once every running stream has had a few tokens, one long prompt: its window."""
    await asyncio.sleep(2.0)
    sent = time.perf_counter()
    res = await _one(connect, url, model, prompt, 1)
    return {"prompt_len": len(prompt), "sent": sent, "done": time.perf_counter(),
            "ttft_s": res.ttft, "error": res.error if not res.ok else ""}


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


class Launched:
    """`cpmoe serve` started by the benchmark (port chosen at run time), stopped at the end."""

    READY = re.compile(r"cpmoe: serving (\S+) at (http://\S+) ")

    def __init__(self, flags: list[str], timeout_s: float = 1800.0) -> None:
        cmd = [sys.executable, "-m", "cpmoe.cli", "serve", "--port", "0", *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout_s
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = self.READY.search(line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                break
            if time.monotonic() > deadline:
                break
        else:
            raise BenchError(f"--launch: the server exited ({self.proc.wait()}) before "
                             f"serving: {''.join(self.log[-5:]).strip()}")
        if not hasattr(self, "url"):
            self.stop()
            raise BenchError(f"--launch: the server was not ready in {timeout_s:.0f} s")
        import threading
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _launched_vocab(flags: list[str]) -> int:
    from cpmoe.config import read_config_json
    from cpmoe.default_model import ensure_default_model
    model = next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--model"), None)
    return int(read_config_json(Path(model) if model else ensure_default_model())["vocab_size"])


def run_bench_serving(args: argparse.Namespace, argv: list[str]) -> int:
    for flag in ("num_prompts", "random_input_len", "random_output_len",
                 "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len",
                 "gsp_num_groups"):
        if getattr(args, flag) < 1:
            raise BenchError(f"--{flag.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, flag)}")
    if not 0.0 < args.random_range_ratio <= 1.0:
        raise BenchError(f"--random-range-ratio must be in (0, 1], got "
                         f"{args.random_range_ratio}")
    if (args.base_url is None) == (args.launch is None):
        raise BenchError("give --base-url URL or --launch SERVE_FLAGS (one of them)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.out.parent and not args.out.parent.is_dir():
        raise BenchError(f"--out {args.out}: folder {args.out.parent} does not exist")
    if args.profile_num_steps is not None and (not args.profile or args.profile_num_steps < 1):
        raise BenchError(f"--profile-num-steps must be >= 1 and comes with --profile, got "
                         f"{args.profile_num_steps}")
    vocab = args.vocab_size or (_launched_vocab(args.launch) if args.launch is not None
                                else None)
    if vocab is None:
        raise BenchError("--base-url: give --vocab-size (token ids are drawn below it)")
    requests = make_requests(args, vocab)
    response_format = read_json_schema(args.json_schema)
    server = Launched(args.launch) if args.launch is not None else None
    try:
        url = server.url if server else args.base_url.rstrip("/")
        model = server.model if server else _served_model(url)
        long_prompt = None
        if args.long_prompt_len:
            rng = random.Random(args.seed + 2)
            long_prompt = [rng.randrange(vocab) for _ in range(args.long_prompt_len)]
        profile = _start_profile(url, args.profile_num_steps) if args.profile else None
        results, wall, long = asyncio.run(run_load(url, model, requests, args.max_concurrency,
                                                   args.request_rate, args.seed, long_prompt,
                                                   response_format))
        if profile is not None and args.profile_num_steps is None:
            _post(url, "/stop_profile", None)
        metrics = _scrape(url)
    finally:
        if server is not None:
            server.stop()
    summary = summarize(results, wall)
    failed = summary["failed"] or (long is not None and long["error"])
    if server is not None and failed:  # the server's side of the failures
        print("cpmoe bench-serving: requests failed; the server's last log lines:\n"
              + "".join(server.log[-40:]), file=sys.stderr)
    if server is not None:  # its batch log: the run's steps as a timeline
        server_log = args.out.with_suffix(".server.log")
        server_log.write_text("".join(server.log))
        print(f"wrote {server_log}")
    summary["server_ttft_s"] = _server_mean(metrics, "cpmoe_time_to_first_token_seconds")
    summary["server_intake_s"] = _server_mean(metrics, "cpmoe_request_intake_seconds")
    if long is not None:
        summary["long_prompt"] = interference(results, long, _chunk_size(args.launch or []))
    head = {**provenance(argv),
            "devices_note": ("this machine, where --launch ran the server" if server else
                             "this client machine; the server at --base-url may differ"),
            "dataset": args.dataset, "num_prompts": args.num_prompts,
            "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            **({f"gsp_{k}": getattr(args, f"gsp_{k}") for k in (
                "system_prompt_len", "question_len", "output_len", "num_groups")}
               if args.dataset == "shared-prefix" else {}),
            "json_schema": str(args.json_schema) if args.json_schema else None,
            "server": args.launch or url,
            "profile": profile}
    args.out.write_text(json.dumps({"header": head, "summary": summary,
                                    "server_metrics": metrics,
                                    "requests": [r.__dict__ for r in results]}, indent=1) + "\n")
    print(report(summary))
    print(f"wrote {args.out}")
    if args.plot:
        warning = plot(results, args.out.with_suffix(".png"))
        print(f"cpmoe bench-serving: warning: {warning}" if warning else
              f"wrote {args.out.with_suffix('.png')}")
    return 1 if failed else 0


def _chunk_size(flags: list[str]) -> int:
    from cpmoe.engine.engine import DEFAULT_CHUNKED_PREFILL
    value = next((flags[i + 1] for i, f in enumerate(flags[:-1])
                  if f == "--chunked-prefill-size"), None)
    return int(value) if value is not None else DEFAULT_CHUNKED_PREFILL


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


def _served_model(url: str) -> str:
    import httpx
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def _post(url: str, path: str, body: dict | None) -> dict:
    import httpx
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    if r.status_code != 200:
        raise BenchError(f"--profile: {path} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def _start_profile(url: str, num_steps: int | None) -> dict:
    """-> the server's answer (output_dir, name); says where the traces will be."""
    started = _post(url, "/start_profile", {} if num_steps is None else
                    {"num_steps": num_steps})
    print(f"profiling the server's {num_steps or 'load'}{' steps' if num_steps else ''}: "
          f"traces {started['output_dir']}/{started['name']}-rank*.trace.json.gz")
    return started


def _scrape(url: str) -> dict:
    """The server's own counters after the run (Prometheus text -> name: value)."""
    import httpx
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except Exception:  # noqa: BLE001 -- a report without server counters
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def _server_mean(metrics: dict, name: str) -> float | None:
    """A histogram's mean from the server's counters (None: a server without it)."""
    n = metrics.get(f"{name}_count")
    return metrics[f"{name}_sum"] / n if n else None


def _long_line(lp: dict) -> str:
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
             *([_long_line(s["long_prompt"])] if s.get("long_prompt") else []),
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
