"""CPU threads of the ranks of one host: `available_cpus` (affinity capped by a cgroup quota)
and `set_cpu_threads` (an equal share each)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota
    (containers often show every host core while their quota allows a few)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = n or 1
    for path, parse in (("/sys/fs/cgroup/cpu.max", _quota_v2),
                        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", _quota_v1)):
        try:
            quota = parse(Path(path))
        except (OSError, ValueError, IndexError):
            continue
        if quota is not None:
            n = min(n, max(1, int(quota)))
        break
    return n


def _quota_v2(path: Path) -> float | None:
    limit, period = path.read_text().split()[:2]
    return None if limit == "max" else int(limit) / int(period)


def _quota_v1(path: Path) -> float | None:
    limit = int(path.read_text())
    period = int((path.parent / "cpu.cfs_period_us").read_text())
    return None if limit <= 0 else limit / period


# A GPU rank's CPU work is launching kernels plus per-step metadata on small tensors; there
# wide OpenMP teams only cost wake-ups. Measured on the lent H200 machine (32 CPUs, no
# quota, one 64K-token prefill): host time before the first kernel 92 ms with 32 threads,
# 12-17 ms with 1-4, each small op 6-12 ms with 32 (bench/phase_times.py --threads).
GPU_RANK_MAX_THREADS = 4


def set_cpu_threads(ranks_on_host: int, kind: str = "cpu") -> None:
    """Give each rank of this host an equal share of the CPUs it may use (at most
    GPU_RANK_MAX_THREADS for a GPU rank)."""
    share = max(1, available_cpus() // max(1, ranks_on_host))
    torch.set_num_threads(min(share, GPU_RANK_MAX_THREADS) if kind == "cuda" else share)
