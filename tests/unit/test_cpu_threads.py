"""The CPU budget of a rank: affinity capped by the cgroup quota, split over the host's ranks."""

import os
from pathlib import Path

import torch

from cpmoe.parallel import cpus


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert cpus._quota_v2(f) is None
    f.write_text("350000 100000\n")
    assert cpus._quota_v2(f) == 3.5


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    f = tmp_path / "cpu.cfs_quota_us"
    f.write_text("-1\n")
    assert cpus._quota_v1(f) is None
    f.write_text("200000\n")
    assert cpus._quota_v1(f) == 2.0


def test_threads_are_an_equal_share(monkeypatch) -> None:
    monkeypatch.setattr(cpus, "available_cpus", lambda: 8)
    before = torch.get_num_threads()
    try:
        cpus.set_cpu_threads(2)
        assert torch.get_num_threads() == 4
        cpus.set_cpu_threads(16)
        assert torch.get_num_threads() == 1
        cpus.set_cpu_threads(1, "cuda")  # GPU ranks: a few threads at most
        assert torch.get_num_threads() == cpus.GPU_RANK_MAX_THREADS
    finally:
        torch.set_num_threads(before)


def test_available_cpus_within_affinity() -> None:
    assert 1 <= cpus.available_cpus() <= len(os.sched_getaffinity(0))
