"""DeepSeek-V4 served next to a long prompt: the bound its streams' inter-token latency must
keep (issue 48; the `v4-serving` part of bench/h200_engine.sh).

    python3 -m bench.v4_serving bound --config V4.json --prompt 65536 --chunk 8192 \
        --streams 32 --out bound.json
    python3 -m bench.v4_serving check --bound bound.json --serving serving.json

`bound` prepares a runner as `cpmoe serve` does (cache from --mem-fraction-static, decode
graphs, warm-up; random weights, uniform routing), then times, synced, every chunk of one
`prompt`-token prompt extended `chunk` tokens a step (each continuing its cached prefix) and
`--steps` decode steps of `streams` sequences of `--context` tokens. `check` reads it and
`cpmoe bench-serving`'s results of the same load (`--long-prompt-len`: the streams' ITL while
the long prompt was prefilled) and fails (exit 1) unless

    p99 ITL during the long prompt <= 2 x (mean chunk prefill + median decode step)

A mixed step runs one chunk and one decode step of every stream, so a stream's gap while
the prompt is prefilled is about their sum; a prompt prefilled whole stalls every stream
for all its chunks at once (8 at 64K / 8K), past the bound. The slowest chunk (the last,
its indexer scoring the longest prefix) is reported beside the mean.
On CPU (`--device cpu`, a tiny config, small lengths) the same commands run the logic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cpmoe.engine.options import EngineOptions, prepare_runner
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.parallel.groups import ProcessGroups


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bound(a: argparse.Namespace) -> int:
    cfg = json.loads(a.config.read_text())
    cuda = a.device == "cuda"
    runner = ModelRunner.from_config(cfg, ProcessGroups.single(a.device),
                                     torch.bfloat16 if cuda else torch.float32)
    tokens = None if cuda else a.prompt + a.streams * (a.context + a.steps) + 64
    opts = EngineOptions(routing="uniform", chunked_prefill_size=a.chunk,
                         max_total_tokens=tokens)
    sizes = prepare_runner(runner, opts, None)
    gen = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]
    prompt = torch.randint(0, vocab, (a.prompt,), generator=gen).tolist()
    chunks = []
    for c in range(0, a.prompt, a.chunk):
        _sync(a.device)
        t0 = time.perf_counter()
        runner.extend([Segment(0, prompt[c:c + a.chunk], c, a.prompt)])
        _sync(a.device)
        chunks.append(time.perf_counter() - t0)
    runner.kv.free(0)
    keys = list(range(1, a.streams + 1))
    seqs = [torch.randint(0, vocab, (a.context,), generator=gen).tolist() for _ in keys]
    last = runner.prefill(seqs, keys, last_only=True).argmax(-1).tolist()
    steps = []
    for _ in range(a.steps):
        _sync(a.device)
        t0 = time.perf_counter()
        last = runner.decode(keys, last).argmax(-1).tolist()  # the tokens reach the host
        steps.append(time.perf_counter() - t0)
    out = {"prompt": a.prompt, "chunk": a.chunk, "streams": a.streams, "context": a.context,
           "kv_capacity": sizes["kv_capacity"], "chunk_s": chunks,
           "chunk_mean_s": statistics.fmean(chunks), "chunk_max_s": max(chunks),
           "decode_step_s": steps, "decode_median_s": statistics.median(steps)}
    a.out.write_text(json.dumps(out, indent=1))
    print(f"{len(chunks)} chunks of {a.chunk} tokens: mean {out['chunk_mean_s'] * 1e3:.1f} ms, "
          f"slowest {out['chunk_max_s'] * 1e3:.1f} ms; decode step of {a.streams} streams at "
          f"{a.context} tokens: median {out['decode_median_s'] * 1e3:.2f} ms "
          f"(cache {sizes['kv_capacity']} tokens)")
    return 0


def check(a: argparse.Namespace) -> int:
    b = json.loads(a.bound.read_text())
    s = json.loads(a.serving.read_text())["summary"]
    lp = s.get("long_prompt")
    if not lp or lp.get("error"):
        print(f"--serving {a.serving}: no long prompt result "
              f"({(lp or {}).get('error', 'run bench-serving with --long-prompt-len')})")
        return 1
    p99 = lp["itl_during_s"]["p99"]
    if p99 is None or s["failed"]:
        print(f"--serving {a.serving}: no stream token during the long prompt, or "
              f"{s['failed']} failed requests")
        return 1
    limit = 2 * (b["chunk_mean_s"] + b["decode_median_s"])
    ok = p99 <= limit
    print(f"streams' p99 ITL during the {lp['prompt_len']}-token prompt {p99 * 1e3:.1f} ms "
          f"{'<=' if ok else '>'} 2 x (chunk {b['chunk_mean_s'] * 1e3:.1f} ms + decode step "
          f"{b['decode_median_s'] * 1e3:.2f} ms) = {limit * 1e3:.1f} ms "
          f"({p99 / limit:.2f} of the bound; slowest chunk {b['chunk_max_s'] * 1e3:.1f} ms, "
          f"the server's step {(lp['step_s'] or 0) * 1e3:.1f} ms)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bound", help="time one chunk's prefill and one decode step")
    b.add_argument("--config", type=Path, required=True, help="the V4 config.json")
    b.add_argument("--prompt", type=int, default=65536)
    b.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size")
    b.add_argument("--streams", type=int, default=32)
    b.add_argument("--context", type=int, default=256, help="tokens of each stream")
    b.add_argument("--steps", type=int, default=16, help="decode steps timed")
    b.add_argument("--device", default="cuda")
    b.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="the serving run's p99 ITL against the bound")
    c.add_argument("--bound", type=Path, required=True)
    c.add_argument("--serving", type=Path, required=True, help="bench-serving --out JSON")
    a = p.parse_args(argv)
    return bound(a) if a.cmd == "bound" else check(a)


if __name__ == "__main__":
    sys.exit(main())
