"""What each rank does in `cpmoe bench` (module-level so spawned ranks can unpickle it).

`setup_task` builds this rank's random-weight shard once per pool (`ModelRunner.from_config`:
the same weights on every layout); `length_task` then measures one prompt length, so a
failure at one length loses nothing measured before it. Results come back on rank 0 only,
with every rank's figures gathered into it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from cpmoe.bench.timing import device_name, free_cached, median, peak_bytes, reset_peak, sync, timed
from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class ModelSpec:
    config: dict  # HF config.json contents
    layout: ParallelLayout
    dtype: torch.dtype
    seed: int
    batch: int
    warmup: int
    iters: int
    placement: str = "static"  # or "balanced": experts placed by a calibration prefill
    quantization: str | None = None  # "fp8": weights quantized to FP8 blocks at load
    kv_cache_dtype: str = "auto"  # "fp8_e4m3": prefill attention in FP8 (CUDA)


INJECT_OOM = "CPMOE_BENCH_INJECT_OOM"  # a length at which length_task fails as out-of-memory

# This rank process's runner between the tasks of one RankPool (a pool serves one layout).
_STATE: dict[str, ModelRunner] = {}


def prompts(vocab_size: int, length: int, batch: int, seed: int) -> list[list[int]]:
    """Random token ids, the same on every rank and for every engine (CPU generator)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + length)
    return torch.randint(0, vocab_size, (batch, length), generator=gen).tolist()


def setup_task(info: RankInfo, spec: ModelSpec) -> dict | None:
    groups = ProcessGroups.build(spec.layout, info.rank, info.device)
    t0 = time.perf_counter()
    runner = ModelRunner.from_config(spec.config, groups, spec.dtype, seed=spec.seed,
                                     quantization=spec.quantization)
    runner.use_kv_cache_dtype(spec.kv_cache_dtype)
    sync(info.device)
    build_s = time.perf_counter() - t0
    _STATE["runner"] = runner
    weights = torch.tensor([float(runner.weight_bytes())], dtype=torch.float64,
                           device=info.device)
    per_rank = runner.gather_from_ranks(weights)
    if info.rank != 0:
        return None
    return {"weight_bytes": [int(w[0]) for w in per_rank], "build_s": build_s,
            "device_name": device_name(info.device)}


def length_task(info: RankInfo, spec: ModelSpec, length: int, keep_logits: bool
                ) -> dict | None:
    """Warm-up, timed prefills, then one more prefill with collective timing on."""
    if os.environ.get(INJECT_OOM) == str(length):  # tests of the out-of-memory path
        raise torch.cuda.OutOfMemoryError(f"injected: CUDA out of memory at length {length}")
    runner = _STATE["runner"]
    groups, device = runner.groups, info.device
    seqs = prompts(runner.config.vocab_size, length, spec.batch, spec.seed)

    def step() -> torch.Tensor:
        return runner.prefill(seqs, last_only=True)

    balance = None
    if spec.placement == "balanced":  # calibrate on a prompt of this length, another seed
        runner.record_expert_load()
        runner.prefill(prompts(runner.config.vocab_size, length, spec.batch, spec.seed + 1),
                       last_only=True)
        report = runner.rebalance_experts()
        balance = {"calibration_tokens": length * spec.batch,
                   "busiest_rank_load_vs_mean_before": report.busiest_before,
                   "busiest_rank_load_vs_mean_after": report.busiest_after}
    free_cached(device)
    reset_peak(device)
    for _ in range(spec.warmup):
        step()
    times = [timed(step, device)[1] for _ in range(spec.iters)]
    peak = peak_bytes(device)
    groups.start_timing()
    try:
        logits = step()
    finally:
        comm_by_group = groups.stop_timing()
    kinds = [g.name for g in groups.all]
    mine = [median(times), float(peak), sum(comm_by_group.values()),
            *[comm_by_group.get(k, 0.0) for k in kinds]]
    per_rank = runner.gather_from_ranks(torch.tensor(mine, dtype=torch.float64, device=device))
    if info.rank != 0:
        return None
    return {
        "seconds_per_rank": [float(r[0]) for r in per_rank],
        "seconds_iters_rank0": times,
        "peak_bytes_per_rank": [int(r[1]) for r in per_rank],
        "comm_s_per_rank": [float(r[2]) for r in per_rank],
        "comm_s_by_group_per_rank": [{k: float(v) for k, v in zip(kinds, r[3:]) if v > 0}
                                     for r in per_rank],
        "logits": logits.cpu() if keep_logits else None,
        "placement": balance,
    }
