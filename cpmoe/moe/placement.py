"""Which EP rank holds which routed expert, chosen from measured expert load.

With expert parallelism every EP rank computes the routed slots of its own experts, so the
slowest rank sets the pace of every MoE layer. Experts are not equally popular (a trained
router is only balanced on average; random weights are not balanced at all), so the fixed
split -- experts [r*E_loc, (r+1)*E_loc) on EP rank r -- can give one rank far more slots
than another. A placement is a per-layer permutation: physical slot p (EP rank p // E_loc,
local index p % E_loc) holds logical expert `physical_to_logical[p]`. The router keeps
speaking logical ids; `ExpertPlacement.route` maps them to physical ids before dispatch, so
dispatchers and experts never know. This is EPLB's placement without redundant copies
(SGLang: `--init-expert-location`, `--enable-eplb`).

Flow: `record()` counts the routed slots of each logical expert during real forwards, then
`rebalance()` sums the counts over the world, places the experts so every EP rank's expected
load is as even as the greedy rule below gets it, and moves the expert weights between EP
ranks with one all-to-all per parameter. The output does not change (tests prove it).

Legend: E = experts (logical = physical count), E_loc = experts per EP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups


def balanced_placement(load_E: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Greedy longest-processing-time placement: heaviest expert first, each to the EP rank
    with the least load that still has a free slot (ties: lower rank). Within a rank the
    experts keep ascending logical order. -> physical_to_logical [E] (int64)."""
    E = load_E.numel()
    if E % ep_size:
        raise ValueError(f"{E} experts do not split over {ep_size} EP ranks")
    per_rank = E // ep_size
    order = sorted(range(E), key=lambda e: (-float(load_E[e]), e))
    loads, members = [0.0] * ep_size, [[] for _ in range(ep_size)]
    for e in order:
        r = min((r for r in range(ep_size) if len(members[r]) < per_rank),
                key=lambda r: (loads[r], r))
        members[r].append(e)
        loads[r] += float(load_E[e])
    return torch.tensor([e for m in members for e in sorted(m)], dtype=torch.int64)


def choose_placement(load_E: torch.Tensor, current: torch.Tensor, ep_size: int) -> torch.Tensor:
    """The balanced placement if it lowers the busiest EP rank's load, else `current` (no
    weights move for nothing)."""
    new = balanced_placement(load_E, ep_size)
    if rank_loads(load_E, new, ep_size).max() < rank_loads(load_E, current, ep_size).max():
        return new
    return current


def rank_loads(load_E: torch.Tensor, physical_to_logical: torch.Tensor,
               ep_size: int) -> torch.Tensor:
    """Slots each EP rank receives under a placement: [ep_size]."""
    return load_E.double()[physical_to_logical].view(ep_size, -1).sum(dim=1)


class ExpertPlacement(nn.Module):
    """One MoE layer's placement and load counter. Identity until `rebalance` moves it."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.register_buffer("physical_to_logical", torch.arange(num_experts), persistent=False)
        self.register_buffer("logical_to_physical", torch.arange(num_experts), persistent=False)
        self.identity = True
        self.load: torch.Tensor | None = None  # slots per logical expert while recording

    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids from the router -> physical ids for dispatch (counted first)."""
        if self.load is not None:
            flat = topk_ids.flatten()
            self.load.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync
        return topk_ids if self.identity else self.logical_to_physical[topk_ids]

    def set(self, physical_to_logical: torch.Tensor) -> None:
        p2l = physical_to_logical.to(self.physical_to_logical.device)
        self.physical_to_logical.copy_(p2l)
        self.logical_to_physical[p2l] = torch.arange(self.num_experts, device=p2l.device)
        self.identity = bool((p2l == torch.arange(self.num_experts, device=p2l.device)).all())


def layers_with_placement(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks of a model: every module with a `placement` and its `experts`."""
    return [m for m in model.modules() if isinstance(getattr(m, "placement", None),
                                                     ExpertPlacement)]


def record(model: nn.Module) -> None:
    """Start (or restart) counting routed slots per logical expert in every MoE layer."""
    for block in layers_with_placement(model):
        p = block.placement
        p.load = torch.zeros(p.num_experts, dtype=torch.int64,
                             device=p.physical_to_logical.device)


@dataclass(frozen=True)
class RebalanceReport:
    layers: int
    busiest_before: float  # mean over layers of max rank load / mean rank load
    busiest_after: float
    experts_moved: int     # on this rank


def rebalance(model: nn.Module, groups: ProcessGroups) -> RebalanceReport:
    """Place every MoE layer's experts by the load recorded since `record()` (summed over the
    world: every rank decides the same placement) and move the weights. Stops recording."""
    blocks = layers_with_placement(model)
    if not blocks or any(b.placement.load is None for b in blocks):
        raise RuntimeError("rebalance() needs record() and at least one forward first")
    ep = groups.layout.ep_size
    loads = comm.all_reduce(torch.stack([b.placement.load for b in blocks]), groups.world)
    loads = loads.cpu()
    before, after, moved = [], [], 0
    for block, load_E in zip(blocks, loads):
        p = block.placement
        p.load = None
        if float(load_E.sum()) == 0:
            raise RuntimeError("rebalance(): no routed slot was recorded")
        old = p.physical_to_logical.cpu()
        new = choose_placement(load_E, old, ep)
        before.append(_imbalance(rank_loads(load_E, old, ep)))
        after.append(_imbalance(rank_loads(load_E, new, ep)))
        if not torch.equal(old, new):
            moved += _move_experts(block.experts, old, new, groups)
        p.set(new)
    n = len(blocks)
    return RebalanceReport(n, sum(before) / n, sum(after) / n, moved)


def _imbalance(per_rank: torch.Tensor) -> float:
    return float(per_rank.max() / per_rank.mean())


def _move_experts(experts: nn.Module, old: torch.Tensor, new: torch.Tensor,
                  groups: ProcessGroups) -> int:
    """Every expert-major parameter ([E_loc, ...]) of this rank's shard rewritten so local
    slot j holds logical expert new[rank*E_loc + j]; the rows come from whichever EP rank
    holds them under `old`, in one all-to-all per parameter. -> local slots whose expert
    changed."""
    ep, rank = groups.moe_ep.size, groups.moe_ep.rank
    per_rank = old.numel() // ep
    where = torch.empty_like(old)
    where[old] = torch.arange(old.numel())  # logical -> old physical slot
    # what this rank sends to each peer d: its own experts that d's new slots need, in d's
    # slot order; what it receives from each peer s: the experts its new slots need from s
    send_slots: list[int] = []
    send_counts = []
    for d in range(ep):
        mine = [int(where[e]) - rank * per_rank for e in new[d * per_rank:(d + 1) * per_rank]
                if int(where[e]) // per_rank == rank]
        send_slots += mine
        send_counts.append(len(mine))
    sources = [int(where[e]) // per_rank for e in new[rank * per_rank:(rank + 1) * per_rank]]
    recv_counts = [sources.count(s) for s in range(ep)]
    # received rows arrive grouped by source rank, each group in this rank's slot order
    arrival = sorted(range(per_rank), key=lambda j: (sources[j], j))
    index = torch.tensor(send_slots, dtype=torch.int64)
    for param in experts.parameters(recurse=False):
        if param.dim() == 0 or param.shape[0] != per_rank:
            continue
        recv = comm.all_to_all(param.data[index.to(param.device)], send_counts, recv_counts,
                               groups.moe_ep)
        param.data[torch.tensor(arrival, device=param.device)] = recv
    own = slice(rank * per_rank, (rank + 1) * per_rank)
    return int((new[own] != old[own]).sum())
