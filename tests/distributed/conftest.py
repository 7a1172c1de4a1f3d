"""One rank pool per world size for the whole distributed suite.

Spawning a pool costs an interpreter and a torch import per rank (about 3 CPU-seconds each:
half a minute for the 2-, 4- and 8-rank pools on a 2-core machine), so every module that
runs tasks on ranks asks `pools(world)` and gets the same live pool; a pool that died (a
failed task kills it) is replaced on the next call. Idle ranks wait on a pipe (no CPU).
test_launch.py's tests of a healthy pool use these too; its tests that kill or close a pool
make their own.
"""

from __future__ import annotations

import pytest

from cpmoe.parallel.launch import RankPool

# the slowest task (the V4 4K-token cache test on 4 ranks of 2 cores) waits minutes for peers
COLLECTIVE_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def pools():
    live: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in live or not live[world].alive:
            live[world] = RankPool(world, "cpu", collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        return live[world]

    yield get
    for pool in live.values():
        pool.close()
