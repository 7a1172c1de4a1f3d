"""Is a short prefill host-bound? One prompt through the whole model on one GPU: the wall
time of each prefill (host-synced), then a profile of one, sorted by host time, whose
totals say how much of the step the host's work and the GPU's kernels take.

    python3 -m bench.short_prefill --length 1024
    python3 -m bench.short_prefill --length 1024 --quantization fp8 --kv-cache-dtype fp8_e4m3

Random weights at Qwen3-30B-A3B's shape (48 layers), bf16, KV pages allocated as a server
does (the prompt's K/V written to them), each prefill under a fresh cache key; the first
prefill compiles kernels and is listed, not excluded. A served 1K prompt's prefill step is
this (`cpmoe serve` logs it as "Prefill batch"): at c7c02fd on an H100 FP8 took 143 ms
against bf16's 43 ms with less GPU time (21 against 24 ms), its host work 117 ms
(bench/results/fp8-prefill-1k-c7c02fd.log).
"""

from __future__ import annotations

import argparse
import time

import torch

from cpmoe.bench.model_task import prompts
from cpmoe.bench.spec import SHAPES
from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--prefills", type=int, default=8)
    p.add_argument("--quantization", choices=("fp8",))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"))
    p.add_argument("--rows", type=int, default=25, help="profile rows printed")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.short_prefill: needs a CUDA GPU")
    cfg = dict(SHAPES["qwen3-30b-a3b"])
    runner = ModelRunner.from_config(cfg, ProcessGroups.single("cuda"), torch.bfloat16,
                                     quantization=a.quantization)
    runner.use_kv_cache_dtype(a.kv_cache_dtype)
    runner.allocate_kv(32 * a.length, kv_dtype=a.kv_cache_dtype)
    seqs = prompts(cfg["vocab_size"], a.length, 1, seed=0)
    walls = []
    for i in range(a.prefills):
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.prefill(seqs, cache_keys=[i], last_only=True)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        runner.kv.free(i)
    print(f"{a.quantization or 'bf16'} kv {a.kv_cache_dtype} {a.length} tokens: wall ms "
          f"{[round(w * 1e3, 1) for w in walls]}")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        runner.prefill(seqs, cache_keys=[a.prefills], last_only=True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows,
                                    max_name_column_width=60))


if __name__ == "__main__":
    main()
