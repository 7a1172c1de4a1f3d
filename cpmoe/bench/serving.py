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
from the server's /metrics over the run (its counters less the warm-up's), its own TTFT (arrival -> first token) and the
intake within it (body read, parsed, tokenized). Each request has its own connection.
The summary and table are `serving_report.py`; the launched server and its probes
`serving_server.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import ssl
import sys
import time
from pathlib import Path

from cpmoe.bench.provenance import provenance
from cpmoe.bench.serving_report import Outcome, interference, plot, report, summarize
from cpmoe.bench.serving_server import (Launched, chunk_size, launched_vocab, post, scrape,
                                        served_model, server_mean, start_profile)
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
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="untimed requests sent first, one at a time (random prompts of the "
                        "first request's length, its output length up to 32, and its "
                        "response format), as sglang.bench_serving does: a schema's grammar "
                        "compiles then, not in the timed run")
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


async def warm_up(url: str, model: str, first: tuple[list[int], int], n: int, vocab: int,
                  seed: int, response_format: dict | None) -> None:
    """`n` untimed requests, one after the other; their prompts are drawn apart from the
    run's, so the prefix cache holds none of the timed prompts."""
    import httpx
    rng = random.Random(seed + 3)
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(len(first[0]))]
        res = await _one(lambda: httpx.AsyncClient(timeout=httpx.Timeout(3600.0)), url, model,
                         prompt, min(first[1], 32), response_format)
        if not res.ok:
            raise BenchError(f"--warmup-requests: warm-up request {i} failed: {res.error}")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


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
    if args.warmup_requests < 0:
        raise BenchError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.out.parent and not args.out.parent.is_dir():
        raise BenchError(f"--out {args.out}: folder {args.out.parent} does not exist")
    if args.profile_num_steps is not None and (not args.profile or args.profile_num_steps < 1):
        raise BenchError(f"--profile-num-steps must be >= 1 and comes with --profile, got "
                         f"{args.profile_num_steps}")
    vocab = args.vocab_size or (launched_vocab(args.launch) if args.launch is not None
                                else None)
    if vocab is None:
        raise BenchError("--base-url: give --vocab-size (token ids are drawn below it)")
    requests = make_requests(args, vocab)
    response_format = read_json_schema(args.json_schema)
    server = Launched(args.launch) if args.launch is not None else None
    if server is not None:  # a SIGTERM (a time limit's) still stops the server it started
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        url = server.url if server else args.base_url.rstrip("/")
        model = server.model if server else served_model(url)
        long_prompt = None
        if args.long_prompt_len:
            rng = random.Random(args.seed + 2)
            long_prompt = [rng.randrange(vocab) for _ in range(args.long_prompt_len)]
        if args.warmup_requests:
            asyncio.run(warm_up(url, model, requests[0], args.warmup_requests, vocab, args.seed,
                                response_format))
        before = scrape(url)  # the run's counters start here, after the warm-up
        profile = start_profile(url, args.profile_num_steps) if args.profile else None
        results, wall, long = asyncio.run(run_load(url, model, requests, args.max_concurrency,
                                                   args.request_rate, args.seed, long_prompt,
                                                   response_format))
        if profile is not None and args.profile_num_steps is None:
            post(url, "/stop_profile", None)
        metrics = scrape(url, since=before)
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
    summary["server_ttft_s"] = server_mean(metrics, "cpmoe_time_to_first_token_seconds")
    summary["server_intake_s"] = server_mean(metrics, "cpmoe_request_intake_seconds")
    if long is not None:
        summary["long_prompt"] = interference(results, long, chunk_size(args.launch or []))
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
            "warmup_requests": args.warmup_requests,
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


