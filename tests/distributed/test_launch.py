"""Tests for cpmoe.parallel.launch: pooled gloo worlds on CPU, fail-fast, torchrun joining.

Invariants the tests rely on: task functions live in _launch_helpers (picklable by reference);
healthy pools are the distributed suite's shared ones (conftest `pools`: the 2- and 4-rank
pools exist anyway); every test that breaks a pool builds its own (on cpu a fork of the
process's forkserver, which imported torch once: about 0.1 s, not an interpreter and a torch
import per rank).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import _launch_helpers as h
from cpmoe.parallel.failures import RankFailure
from cpmoe.parallel.launch import RankPool, launch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _gone(pid: int) -> bool:
    # Reaped processes no longer exist; a zombie (unreaped child) would still answer signal 0.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pids(pool: RankPool) -> list[int]:
    return [pid for _, pid in pool.run(h.gather_pid)]


@pytest.fixture(params=[2, 4], ids=lambda n: f"world{n}")
def pool(request: pytest.FixtureRequest, pools) -> RankPool:
    return pools(request.param)


def test_pool_runs_all_reduce_and_returns_per_rank_results(pool: RankPool) -> None:
    n = pool.world_size
    results = pool.run(h.all_reduce_rank, scale=2, timeout_s=30)
    assert [r["rank"] for r in results] == list(range(n))
    assert all(r["world_size"] == n and r["device"] == "cpu" for r in results)
    assert all(r["sum"] == 2 * n * (n + 1) / 2 for r in results)
    assert all(r["threads"] == max(1, (os.cpu_count() or 1) // n) for r in results)


def test_same_pool_runs_a_second_different_task(pool: RankPool) -> None:
    first = _pids(pool)
    assert len(set(first)) == pool.world_size
    assert pool.run(h.all_reduce_rank)[0]["sum"] == sum(range(1, pool.world_size + 1))
    assert _pids(pool) == first  # same processes: the pool was reused, not restarted
    assert pool.alive


def test_unpicklable_task_is_rejected_in_parent_and_pool_survives(pool: RankPool) -> None:
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pool.run(lambda info: info.rank)
    assert pool.alive
    assert len(_pids(pool)) == pool.world_size


def test_rank_raising_during_peer_all_reduce_fails_fast_with_traceback_and_kills_all() -> None:
    pool = RankPool(3)
    pids = _pids(pool)
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        pool.run(h.fail_in_collective, 1, "raise")
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed
    err = caught.value
    assert err.rank == 1
    assert str(err).splitlines()[0] == "rank 1 failed: ValueError: boom from rank 1"
    assert type(err.error) is ValueError and str(err.error) == "boom from rank 1"
    assert err.remote_traceback is not None and "Traceback" in err.remote_traceback
    assert "fail_in_collective" in str(err) and "raise ValueError" in str(err)
    assert not pool.alive
    assert all(_gone(pid) for pid in pids)


def test_rank_dying_by_os_exit_is_reported_and_dead_pool_refuses_run() -> None:
    pool = RankPool(2)
    pids = _pids(pool)
    with pytest.raises(RankFailure) as caught:
        pool.run(h.fail_in_collective, 0, "exit3", timeout_s=30)
    assert caught.value.rank == 0
    assert str(caught.value) == "rank 0 died: exit code 3"
    assert caught.value.remote_traceback is None
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="rank pool is closed"):
        pool.run(h.all_reduce_rank)
    pool.close()
    pool.close()  # idempotent after a failure too


def test_rank_killed_by_sigkill_is_reported_with_signal_name() -> None:
    pool = RankPool(2)
    pids = _pids(pool)
    with pytest.raises(RankFailure) as caught:
        pool.run(h.fail_in_collective, 1, "sigkill", timeout_s=30)
    assert caught.value.rank == 1
    assert str(caught.value) == "rank 1 died: exit code -9 (SIGKILL)"
    assert all(_gone(pid) for pid in pids)


def test_task_timeout_raises_rank_failure_and_kills_the_pool() -> None:
    pool = RankPool(2)
    pids = _pids(pool)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 0 timed out") as caught:
        pool.run(h.fail_in_collective, 1, "hang", timeout_s=1.0)
    assert time.monotonic() - start < 10
    assert "unfinished ranks: [0, 1]" in str(caught.value)
    assert not pool.alive and all(_gone(pid) for pid in pids)


def test_keyboard_interrupt_in_parent_kills_ranks_and_reraises() -> None:
    pool = RankPool(2)
    pids = _pids(pool)
    with pytest.raises(KeyboardInterrupt):
        pool.run(h.interrupt_parent, os.getpid(), timeout_s=30)
    assert not pool.alive and all(_gone(pid) for pid in pids)


def test_ranks_see_the_environment_at_pool_creation_then_the_overrides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On cpu the ranks are forks of a forkserver started earlier (by the shared pools):
    # its environment predates these variables.
    monkeypatch.setenv("CPMOE_TEST_LATE", "set after the forkserver")
    monkeypatch.setenv("CPMOE_TEST_OVERRIDDEN", "parent")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with RankPool(2, env={"CPMOE_TEST_OVERRIDDEN": "override"}) as pool:
        seen = pool.run(h.read_env, "CPMOE_TEST_LATE", "CPMOE_TEST_OVERRIDDEN",
                        "OMP_WAIT_POLICY", "RANK")
    assert seen == [{"CPMOE_TEST_LATE": "set after the forkserver",
                     "CPMOE_TEST_OVERRIDDEN": "override", "OMP_WAIT_POLICY": None,
                     "RANK": str(rank)} for rank in range(2)]


OWNER = """
import sys, time
import _launch_helpers as h
from cpmoe.parallel.launch import RankPool
if __name__ == "__main__":
    pool = RankPool(2)
    print(*(pid for _, pid in pool.run(h.gather_pid)), flush=True)
    pool.run(h.block)
"""


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def _exited(pid: int) -> bool:
    """Gone, or a zombie: once its parent (the killed owner) is gone, who reaps an orphan is
    the machine's init, which in some containers never does."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_ranks_and_helpers_exit_when_the_pool_owner_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
    owner = subprocess.Popen([sys.executable, str(script)], env=env, cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = [owner.stdout.readline()]
        ranks = [int(pid) for pid in lines[0].split()]
        while sum("blocking" in line for line in lines) < len(ranks) and lines[-1]:
            lines.append(owner.stdout.readline())
        busy = sorted(line.strip() for line in lines if "blocking" in line)
        helpers = _children(owner.pid)  # the forkserver (on cpu), the resource tracker
    finally:
        owner.kill()  # no close, no finalizer; the ranks are in a task, not reading their
        owner.wait()  # task pipe: only their watchdog can end them
        owner.stdout.close()
    assert len(ranks) == 2 and busy == ["rank 0 blocking", "rank 1 blocking"], lines
    deadline = time.monotonic() + 10
    while not all(map(_exited, ranks + helpers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in ranks + helpers if not _exited(pid)] == []


def test_closed_pool_refuses_run_and_leaves_no_processes() -> None:
    with RankPool(2) as pool:
        pids = _pids(pool)
    assert not pool.alive and all(_gone(pid) for pid in pids)
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="rank pool is closed"):
        pool.run(h.all_reduce_rank)


def test_launch_world_size_1_runs_in_process_without_process_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = launch(h.report_dist_state, 1, "cpu", tag="solo")
    assert out == {"rank": 0, "world_size": 1, "tag": "solo", "initialized": False}
    assert not dist.is_initialized()


def test_launch_world_size_2_spawns_a_pool_and_returns_rank0_result(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = launch(h.report_dist_state, 2, "cpu", tag="pair")
    assert out == {"rank": 0, "world_size": 2, "tag": "pair", "initialized": True}
    assert not dist.is_initialized()  # the world lived in the children only


def test_launch_world_size_mismatch_with_torchrun_env_raises_clear_value_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3 .* world_size=2"):
        launch(h.report_dist_state, 2, "cpu", tag="x")
    assert not dist.is_initialized()


def test_launch_joins_a_simulated_torchrun_world() -> None:
    with socket.socket() as s:  # torchrun's rank 0 hosts the store; pick it a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "import sys, _launch_helpers as h; h.torchrun_main(2)"
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        # all_reduce of (rank + 1) * 10 over 2 ranks; the group is destroyed after fn returns.
        assert out.strip().splitlines()[-1] == f"RESULT {rank} 30.0 False"
