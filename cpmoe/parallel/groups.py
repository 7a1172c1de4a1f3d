"""Process groups of one rank, built once from a `ParallelLayout` and passed explicitly.

Every rank creates every group in the same order (`new_group` is collective). Two kinds whose
member lists coincide (CP == TP, EP == TP, MOE_DP == ATTN_CP, ...) share one torch
ProcessGroup object instead of creating a duplicate; each kind still gets its own `Group`
handle so collectives can be counted per kind. A group of one rank carries no ProcessGroup at
all, and a one-rank world needs no torch.distributed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cpmoe.parallel.layout import GROUP_KINDS, ParallelLayout


@dataclass(eq=False)
class Group:
    """One rank's view of a group: members, its position in them, and the torch group."""

    name: str
    ranks: tuple[int, ...]
    rank: int  # this rank's index inside `ranks`
    pg: object | None  # torch ProcessGroup; None when the group has a single rank
    check_shapes: bool = False  # exchange shapes before size-sensitive collectives
    stats: Counter = field(default_factory=Counter)  # collectives issued, by op name
    # When a list: every collective appends (op, start, end) CUDA events (or perf_counter
    # floats on CPU) around itself, for benchmarks that report time in communication.
    timings: list | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(eq=False)
class ProcessGroups:
    layout: ParallelLayout
    rank: int
    device: torch.device
    attn_tp: Group
    attn_cp: Group
    moe_ep: Group
    moe_tp: Group
    moe_dp: Group
    moe: Group  # ep * moe_tp ranks that hold one full copy of the experts
    world: Group

    @property
    def all(self) -> tuple[Group, ...]:
        return (self.attn_tp, self.attn_cp, self.moe_ep, self.moe_tp, self.moe_dp, self.moe,
                self.world)

    def reset_stats(self) -> None:
        for g in self.all:
            g.stats.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        return {g.name: dict(g.stats) for g in self.all if g.stats}

    def start_timing(self) -> None:
        for g in self.all:
            g.timings = []

    def stop_timing(self) -> dict[str, float]:
        """Seconds spent inside collectives since start_timing, per group kind (synchronises)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out: dict[str, float] = {}
        for g in self.all:
            for _, start, end in g.timings or []:
                took = (start.elapsed_time(end) / 1e3 if hasattr(start, "elapsed_time")
                        else end - start)
                out[g.name] = out.get(g.name, 0.0) + took
            g.timings = None
        return out

    @classmethod
    def offline(cls, layout: ParallelLayout, rank: int,
                device: torch.device | str = "meta") -> "ProcessGroups":
        """Rank `rank`'s groups with no torch groups behind them: for building a model shard
        to inspect it (sizes, memory), never for running collectives."""
        groups = {}
        for kind in (*GROUP_KINDS, "world"):
            members = tuple(range(layout.world_size)) if kind == "world" else \
                tuple(layout.group_of(kind, rank))
            groups[kind] = Group(kind, members, members.index(rank), None)
        return cls(layout=layout, rank=rank, device=torch.device(device), **groups)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ProcessGroups":
        """The groups of a one-rank world; needs no torch.distributed."""
        return cls.build(ParallelLayout(), 0, torch.device(device))

    @classmethod
    def build(cls, layout: ParallelLayout, rank: int, device: torch.device,
              check_shapes: bool | None = None) -> "ProcessGroups":
        """Collective on a multi-rank world: every rank must call it with the same layout."""
        world = layout.world_size
        if world > 1:
            if not dist.is_initialized():
                raise RuntimeError("a multi-rank layout needs torch.distributed to be initialised")
            if dist.get_world_size() != world:
                raise RuntimeError(f"layout wants {world} ranks (--tp-size) but the "
                                   f"torch.distributed world has {dist.get_world_size()}")
        if check_shapes is None:
            check_shapes = device.type == "cpu"
        created: dict[tuple[int, ...], object] = {}

        def torch_group(members: tuple[int, ...]) -> object | None:
            if len(members) == 1:
                return None
            if members == tuple(range(world)):
                return dist.group.WORLD
            if members not in created:
                created[members] = dist.new_group(list(members))
            return created[members]

        groups: dict[str, Group] = {}
        for kind in (*GROUP_KINDS, "world"):
            member_lists = ([list(range(world))] if kind == "world"
                            else layout.group_members(kind))
            mine = None
            for members in member_lists:  # every rank creates every group, in the same order
                key = tuple(members)
                pg = torch_group(key)
                if rank in key:
                    mine = Group(kind, key, key.index(rank), pg, check_shapes)
            assert mine is not None, f"rank {rank} in no {kind} group"
            groups[kind] = mine
        return cls(layout=layout, rank=rank, device=device, **groups)
