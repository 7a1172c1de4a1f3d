"""Timing and memory helpers shared by the benchmarks (host timers around device syncs).

CUDA work is asynchronous, so every timed region starts and ends with
`torch.cuda.synchronize()`; on CPU the syncs are no-ops and the timers read wall time.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

# NVLink multicast must stay off on the lent multi-GPU machines (shared/notes/gpu-envelope.md);
# children spawned by a RankPool inherit the parent's environment.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def keep_multicast_off() -> None:
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """-> (fn(), seconds), the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def device_timed(fn: Callable[[], Any], device: torch.device,
                 head_start_cycles: int = 4_000_000) -> tuple[Any, float, bool]:
    """-> (fn(), seconds, queued): fn's device time with the host running ahead. On CUDA the
    stream first runs a sleep kernel (~2 ms) while the host queues fn's work behind it, and
    CUDA events around fn time its kernels alone, without launch latency: the regime of a
    prefill (the host is ahead of the GPU) and how nccl-tests times back-to-back
    collectives. queued says whether the host finished queueing before the sleep ended
    (else launch latency leaked into the figure). On CPU: wall time, as `timed`."""
    if device.type != "cuda":
        out, seconds = timed(fn, device)
        return out, seconds, True
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(head_start_cycles)
    start.record()
    out = fn()
    end.record()
    queued = not start.query()  # the sleep is still running: fn is queued behind it
    sync(device)
    return out, start.elapsed_time(end) / 1e3, queued


def cuda_ms(fn: Callable[[], Any], iters: int = 5) -> float:
    """Mean milliseconds of one fn() on the current CUDA stream (one untimed call first),
    for kernel micro-benchmarks."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    """Peak allocated bytes since the last reset (CUDA); -1 where nobody counts (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return -1


def free_cached(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(message: str) -> bool:
    """A rank failure summary (or exception text) that says the device ran out of memory."""
    return "OutOfMemoryError" in message or "out of memory" in message.lower()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def sweep_ms(kernel: Callable[..., Callable[[], Any]], grid: dict[str, tuple], work: int,
             iters: int, unit: str = "tflops", show: int | None = None) -> list[dict]:
    """`kernel(**opts)` (a callable to time) under every option set of `grid` (the product
    of its values) -> [{**opts, ms, <unit>}], fastest first, the `show` fastest printed (all:
    None). `work` is FLOPs (unit "tflops": TFLOP/s) or bytes moved (unit "tbs": TB/s). A set
    that does not build (out of shared memory or registers for its tile) is printed and
    skipped."""
    results = []
    for values in itertools.product(*grid.values()):
        opts = dict(zip(grid, values))
        try:
            ms = cuda_ms(kernel(**opts), iters)
        except Exception as e:  # noqa: BLE001 -- a tile that does not fit is a result
            print(f"  {opts}: failed ({str(e).splitlines()[0][:100]})", flush=True)
            continue
        results.append({**opts, "ms": ms, unit: work / ms / 1e9})
    results.sort(key=lambda r: r["ms"])
    label = {"tflops": "TFLOP/s", "tbs": "TB/s"}[unit]
    for r in results[:show]:
        shown = " ".join(f"{k} {r[k]}" for k in grid)
        print(f"  {shown}: {r['ms']:.3f} ms, {r[unit]:.2f} {label}")
    return results


def run_lengths(name: str, a: Any, available: bool,
                bench_length: Callable[[Any, int, torch.device, torch.Generator], dict]
                ) -> None:
    """The kernel benchmarks' main (bench/v4_*.py): one `bench_length` row per entry of
    `a.lengths` on the GPU, written with provenance to `a.out` when given."""
    if not torch.cuda.is_available() or not available:
        sys.exit(f"bench.{name} needs a CUDA GPU and Triton (none here)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = [bench_length(a, int(n), dev, gen) for n in a.lengths.split(",")]
    if a.out:
        import json

        from cpmoe.bench.provenance import provenance
        with open(a.out, "w") as f:
            json.dump({"header": provenance(), "args": vars(a), "results": rows}, f, indent=1)
        print(f"wrote {a.out}")
