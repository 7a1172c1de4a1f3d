"""Where prefill time goes: torch.profiler over one prefill, top CUDA kernels by self time.

    python3 -m bench.profile_prefill --layout "tp=1" --length 4096 --layers 12
    python3 -m bench.profile_prefill --layout "tp=2,cp=2,ep=2" --length 32768 --layers 12
    python3 -m bench.profile_prefill --config v4.json --length 16384 --layers 4   # DeepSeek-V4
    python3 -m bench.profile_prefill --length 16384 --quantization fp8            # FP8 compute
    python3 -m bench.profile_prefill --length 16384 --quantization fp8 --kv-cache-dtype fp8_e4m3

Builds a random-weight Qwen3-30B-A3B-shaped model (optionally fewer layers: per-layer costs
are the same in every layer), warms up, profiles one prefill and prints a table per rank.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cpmoe.bench.model_task import prompts
from cpmoe.bench.spec import SHAPES, parse_layout
from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo, RankPool


def profile_task(info: RankInfo, config: dict, layout, length: int, rows: int,
                 trace: str | None, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> str:
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner.from_config(config, groups, torch.bfloat16, quantization=quantization)
    runner.use_kv_cache_dtype(kv_cache_dtype)  # fp8_e4m3: prefill attention in FP8 (cuDNN)
    seqs = prompts(config["vocab_size"], length, 1, seed=0)  # the same prompt on every rank
    for _ in range(2):
        runner.prefill(seqs, last_only=True)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        runner.prefill(seqs, last_only=True)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(f"{trace}/rank{info.rank}.json")
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows,
                                      max_name_column_width=70)
    return f"-- rank {info.rank}\n{table}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="tp=1")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--trace", help="folder for a Chrome trace per rank")
    p.add_argument("--config", help="an HF config.json to profile instead (e.g. DeepSeek-V4)")
    p.add_argument("--quantization", choices=("fp8",), help="fp8: the weights quantized to "
                   "128x128-block FP8 at build, FP8 GEMMs (as --quantization fp8 elsewhere)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="fp8_e4m3: prefill attention in FP8 through cuDNN (as elsewhere)")
    a = p.parse_args()
    base = json.loads(Path(a.config).read_text()) if a.config else SHAPES["qwen3-30b-a3b"]
    config = dict(base, num_hidden_layers=a.layers)
    layout = parse_layout(a.layout).layout
    with RankPool(layout.world_size, "cuda") as pool:
        print(f"== {a.layout} length {a.length} layers {a.layers} {a.quantization or ''} "
              f"kv {a.kv_cache_dtype}")
        for table in pool.run(profile_task, config, layout, a.length, a.rows, a.trace,
                              a.quantization, a.kv_cache_dtype):
            print(table)


if __name__ == "__main__":
    main()
