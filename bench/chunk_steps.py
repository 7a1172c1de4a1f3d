"""Each chunk step of one long prompt, as `cpmoe serve` runs it, timed on its own (one H200,
random weights, Qwen3-30B-A3B shape; the long-prompt part of the serving benchmark):

    python3 -m bench.chunk_steps --prompt 65536 --chunk 8192 --streams 32 --repeats 2

The runner is prepared as the server prepares it (KV from --mem-fraction-static, decode
graphs, warm-up). `streams` sequences of 256 tokens are prefilled, then the long prompt is
extended chunk by chunk, each step carrying one decode row of every stream (a mixed step,
`engine.run_step`). Per chunk: the host time to launch it, its time synced, its attention
FLOPs (QK^T and PV over its prefix and itself), and the CUDA caching allocator's cudaMalloc calls
and retries (a retry frees cached blocks: a device sync) during it. The prompt is run
`repeats` times (freed in between): a first pass slower than the second is a one-time cost
(a kernel compiled or memory reserved), not the chunk's own.
"""

from __future__ import annotations

import argparse
import time

import torch

from cpmoe.bench.spec import SHAPES
from cpmoe.engine.engine import run_step
from cpmoe.engine.options import EngineOptions, prepare_runner
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.engine.request import StepPlan
from cpmoe.parallel.groups import ProcessGroups


def _alloc_counts() -> tuple[int, int]:
    if not torch.cuda.is_available():
        return 0, 0
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (--shape tiny)")
    args = p.parse_args()
    cfg = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    cuda = args.device == "cuda"
    runner = ModelRunner.from_config(cfg, ProcessGroups.single(args.device),
                                     torch.bfloat16 if cuda else torch.float32)
    opts = EngineOptions(routing="uniform", chunked_prefill_size=args.chunk,
                         max_total_tokens=None if cuda else 2 * args.prompt + 4096 +
                         256 * args.streams)
    sizes = prepare_runner(runner, opts, None)
    print(f"KV {sizes['kv_capacity']} tokens, graphs {sizes['graph_bytes'] / 2**20:.0f} MiB"
          + (f", reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB" if cuda else ""),
          flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]
    streams = list(range(1, args.streams + 1))
    if streams:
        runner.extend([Segment(k, torch.randint(1, vocab, (256,), generator=gen).tolist())
                       for k in streams])
    heads, dim, layers = cfg["num_attention_heads"], cfg["head_dim"], args.layers
    print("| pass | chunk | start | host ms | synced ms | attention TFLOP | "
          "cudaMalloc | alloc retries |")
    print("|---|---|---|---|---|---|---|---|")
    for rep in range(args.repeats):
        key = 10_000 + rep
        ids = torch.randint(1, vocab, (args.prompt,), generator=gen).tolist()
        for c, start in enumerate(range(0, args.prompt, args.chunk)):
            chunk = ids[start:start + args.chunk]
            n = len(chunk)
            # the chunk's queries against its prefix and (causally) itself, QK^T and PV
            flops = 4 * n * (start + n / 2) * heads * dim * layers
            plan = StepPlan(extend=[(key, chunk, start)],
                            decode=[(k, 1) for k in streams])
            if cuda:
                torch.cuda.synchronize()
            allocs0, retries0 = _alloc_counts()
            t0 = time.perf_counter()
            run_step(runner, plan, None)
            host = time.perf_counter() - t0
            if cuda:
                torch.cuda.synchronize()
            synced = time.perf_counter() - t0
            allocs1, retries1 = _alloc_counts()
            print(f"| {rep + 1} | {c + 1} | {start} | {host * 1e3:.1f} | {synced * 1e3:.1f} | "
                  f"{flops / 1e12:.1f} | {allocs1 - allocs0} | "
                  f"{retries1 - retries0} |", flush=True)
        runner.kv.free(key)


if __name__ == "__main__":
    main()
