"""What an extend step over cached prefixes costs on the GPU, beside the same new tokens
without a prefix (one H200, random weights, Qwen3-30B-A3B shape; the prefix-cache TTFT):

    python3 -m bench.prefix_step --layers 48 --prefix 2048 --new 128 --seqs 6

Prefills one prefix, then times (CUDA events, median of 5) an extend of `seqs` sequences of
`new` tokens each forked from it (their cached prefix attended), the same tokens as new
sequences with no prefix, and the host time of building each step; then a torch.profiler
table of the prefix step's kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpmoe.bench.spec import SHAPES
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.parallel.groups import ProcessGroups


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--seqs", type=int, default=6)
    args = p.parse_args()
    cfg = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": args.layers}
    runner = ModelRunner.from_config(cfg, ProcessGroups.single("cuda"), torch.bfloat16)
    runner.allocate_kv(args.prefix * 4 + args.seqs * args.new * 16, 16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg["vocab_size"], (args.prefix + args.seqs * args.new * 12,),
                        generator=gen).tolist()
    runner.extend([Segment(0, ids[:args.prefix])])
    kv, key = runner.kv, [100]

    def step(prefixed: bool) -> tuple[float, float]:
        segs = []
        for i in range(args.seqs):
            key[0] += 1
            at = args.prefix + key[0] * args.new % (len(ids) - args.prefix - args.new)
            new = ids[at:at + args.new]
            if prefixed:
                kv.fork(key[0], 0, args.prefix)
                segs.append(Segment(key[0], new, args.prefix))
            else:
                segs.append(Segment(key[0], new))
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        runner.extend(segs)
        host = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        for s in segs:
            kv.free(s.key)
        return start.elapsed_time(end), host * 1e3

    for prefixed in (True, False):
        step(prefixed)
        runs = [step(prefixed) for _ in range(5)]
        print(f"{'prefix' if prefixed else 'no prefix'}: {args.seqs} x {args.new} new tokens"
              f"{f' after {args.prefix} cached' if prefixed else ''}: GPU "
              f"{statistics.median(r[0] for r in runs):.2f} ms, host (launch) "
              f"{statistics.median(r[1] for r in runs):.2f} ms")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step(True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25,
                                    max_name_column_width=70))


if __name__ == "__main__":
    main()
