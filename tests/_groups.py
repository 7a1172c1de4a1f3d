"""`destroy_subgroups`: the rank task the session pools (tests/conftest.py `pools`) run after
every task, so that no test leaves process groups behind in their ranks.

Every test task builds its layout's groups (`ProcessGroups.build`: `dist.new_group`), and
torch keeps each one registered, with its gloo transport, until `destroy_process_group`.
Each gloo group has a loop thread that wakes about 100 times a second even when idle (an
`epoll_wait` with a 10 ms timeout; 70/s counted on a loaded machine). The ranks of a session
pool gathered about 60 such groups each over tests/distributed (179 threads in one rank) and
then spent ~8% of a core apiece idling for the rest of the run: with the 2-, 4- and 8-rank
pools, most of a core of the 2. Measured: ten builds of a tp4-cp2-ep2 layout left 65 threads
and 2.4% of a core per idle rank; after this task 8 threads and nothing.
Importable by name in a rank (RankPool pickles tasks by reference).
"""

from __future__ import annotations

import torch.distributed as dist


def destroy_subgroups(info) -> int:
    """Destroy every process group of this rank but the world's -> how many."""
    from torch.distributed.distributed_c10d import _world  # no public list of the groups
    groups = [pg for pg in list(_world.pg_map) if pg is not dist.group.WORLD]
    for pg in groups:
        dist.destroy_process_group(pg)
    return len(groups)
