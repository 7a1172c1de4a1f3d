"""Module-level task functions for test_launch.py.

Invariant: everything here is importable by name in a spawned rank (RankPool pickles tasks by
reference), so tasks live in this module rather than inside the test functions.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from cpmoe.parallel.launch import RankInfo, launch


def all_reduce_rank(info: RankInfo, scale: int = 1) -> dict[str, object]:
    """Sum of (rank + 1) * scale over the world, plus identity fields to check per-rank results."""
    t = torch.tensor([float((info.rank + 1) * scale)], device=info.device)
    dist.all_reduce(t)
    return {"rank": info.rank, "world_size": info.world_size, "sum": t.item(),
            "device": str(info.device), "threads": torch.get_num_threads()}


def gather_pid(info: RankInfo) -> tuple[int, int]:
    """A different task than all_reduce_rank: proves reuse, and lets tests watch the pids."""
    out = [None] * info.world_size
    dist.all_gather_object(out, os.getpid())
    return info.rank, out[info.rank]


def fail_in_collective(info: RankInfo, bad_rank: int, how: str) -> float:
    """bad_rank fails in the way `how` names while every other rank blocks in an all_reduce."""
    if info.rank == bad_rank:
        time.sleep(0.3)  # let the peers enter the collective first
        if how == "raise":
            raise ValueError(f"boom from rank {info.rank}")
        if how == "exit3":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def interrupt_parent(info: RankInfo, owner_pid: int) -> None:
    """Rank 0 sends SIGINT to the pool's owner, as a Ctrl-C would; all ranks then block.
    (The owner's pid is passed: a cpu rank's parent process is the forkserver.)"""
    if info.rank == 0:
        os.kill(owner_pid, signal.SIGINT)
    time.sleep(3600)


def block(info: RankInfo) -> None:
    """Say so on stdout, then stay busy in this task (not reading the task pipe)."""
    sys.stdout.write(f"rank {info.rank} blocking\n")  # one line, one write
    sys.stdout.flush()
    time.sleep(3600)


def read_env(info: RankInfo, *names: str) -> dict[str, str | None]:
    """These environment variables as this rank sees them."""
    return {name: os.environ.get(name) for name in names}


def report_dist_state(info: RankInfo, tag: str) -> dict[str, object]:
    """What launch() gave this function: rank info and whether a process group exists."""
    return {"rank": info.rank, "world_size": info.world_size, "tag": tag,
            "initialized": dist.is_available() and dist.is_initialized()}


def torchrun_main(world_size: int) -> None:
    """Body of a simulated torchrun rank: launch() an all_reduce and print the result last."""
    result = launch(all_reduce_rank, world_size, "cpu", scale=10)
    print("RESULT", result["rank"], result["sum"], dist.is_initialized(), flush=True)
