"""Every collective cpmoe issues, in one place, each taking an explicit `Group`.

Invariants:
- A one-rank group is the identity: no torch.distributed call is made, so one-rank runs
  need no process group at all.
- Rows are dim 0. All-gathers concatenate rank-major: rank i's rows at [i*n, (i+1)*n).
- With `group.check_shapes` (on by default for gloo/CPU runs) size-sensitive collectives
  first exchange shapes and raise a readable error on a mismatch instead of hanging or
  corrupting memory.
- Each call increments `group.stats[op]`, which tests read to assert collective counts.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from cpmoe.parallel.groups import Group

# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


class CollectiveShapeError(RuntimeError):
    pass


def _count(group: Group, op: str) -> None:
    group.stats[op] += 1


class _timed:
    """Records the span of one collective into group.timings when timing is on."""

    def __init__(self, group: Group, op: str, x: torch.Tensor) -> None:
        self.group, self.op, self.cuda = group, op, x.is_cuda

    def __enter__(self) -> None:
        if self.group.timings is not None:
            self.start = _mark(self.cuda)

    def __exit__(self, *exc: object) -> None:
        if self.group.timings is not None:
            self.group.timings.append((self.op, self.start, _mark(self.cuda)))


def _mark(cuda: bool):
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _check_same_shape(x: torch.Tensor, group: Group, op: str, skip_dim0: bool = False) -> None:
    if not group.check_shapes:
        return
    shape = torch.tensor([x.dim(), *x.shape, *[0] * (8 - x.dim())], dtype=torch.int64)
    shapes = [torch.empty_like(shape) for _ in range(group.size)]
    dist.all_gather(shapes, shape.to(_comm_device(group, x)), group=group.pg)
    shapes = [tuple(s.tolist()) for s in shapes]
    first = [s[2:] if skip_dim0 else s for s in shapes]
    if any(s != first[0] for s in first):
        dims = [f"rank {group.ranks[i]}: {list(s[1:1 + s[0]])}" for i, s in enumerate(shapes)]
        raise CollectiveShapeError(f"{op} over group {group.name} got mismatched shapes "
                                   f"({'; '.join(dims)})")


def _comm_device(group: Group, x: torch.Tensor) -> torch.device:
    return x.device if x.device.type != "meta" else torch.device("cpu")


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, in place; returns x."""
    if group.size == 1:
        return x
    _count(group, "all_reduce")
    _check_same_shape(x, group, "all_reduce")
    with _timed(group, "all_reduce", x):
        dist.all_reduce(x, group=group.pg)
    return x


def all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[n, ...] on every rank -> [size * n, ...], rank-major. All ranks must pass the same n."""
    if group.size == 1:
        return x
    _count(group, "all_gather")
    _check_same_shape(x, group, "all_gather")
    x = x.contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    with _timed(group, "all_gather", x):
        _all_gather_single(out, x, group=group.pg)
    return out


def reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[size * n, ...] partial sums -> this rank's [n, ...] slice of the total."""
    if group.size == 1:
        return x
    _count(group, "reduce_scatter")
    _check_same_shape(x, group, "reduce_scatter")
    if x.shape[0] % group.size:
        raise CollectiveShapeError(f"reduce_scatter over {group.name}: {x.shape[0]} rows do not "
                                   f"split over {group.size} ranks")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    with _timed(group, "reduce_scatter", x):
        _reduce_scatter_single(out, x, group=group.pg)
    return out


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
               group: Group) -> torch.Tensor:
    """Rows [sum(send_counts), ...] -> rows [sum(recv_counts), ...]; counts per group rank."""
    if len(send_counts) != group.size or len(recv_counts) != group.size:
        raise CollectiveShapeError(f"all_to_all over {group.name}: counts for "
                                   f"{len(send_counts)}/{len(recv_counts)} ranks, group has "
                                   f"{group.size}")
    if x.shape[0] != sum(send_counts):
        raise CollectiveShapeError(f"all_to_all over {group.name}: {x.shape[0]} rows but "
                                   f"send counts sum to {sum(send_counts)}")
    if group.size == 1:
        return x
    _count(group, "all_to_all")
    _check_same_shape(x, group, "all_to_all", skip_dim0=True)
    x = x.contiguous()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    with _timed(group, "all_to_all", x):
        dist.all_to_all_single(out, x, recv_counts, send_counts, group=group.pg)
    return out


def exchange_counts(send_counts: torch.Tensor, group: Group) -> torch.Tensor:
    """int64 [size] rows this rank sends to each peer -> rows it receives from each peer."""
    if group.size == 1:
        return send_counts
    _count(group, "exchange_counts")
    send_counts = send_counts.to(torch.int64).contiguous()
    recv = torch.empty_like(send_counts)
    with _timed(group, "exchange_counts", send_counts):
        dist.all_to_all_single(recv, send_counts, group=group.pg)
    return recv


def barrier(group: Group) -> None:
    if group.size > 1:
        _count(group, "barrier")
        dist.barrier(group=group.pg)


def broadcast(x: torch.Tensor, group: Group, src_index: int = 0) -> torch.Tensor:
    """Overwrite x on every rank with the copy of group member `src_index`; returns x."""
    if group.size == 1:
        return x
    _count(group, "broadcast")
    _check_same_shape(x, group, "broadcast")
    with _timed(group, "broadcast", x):
        dist.broadcast(x, src=group.ranks[src_index], group=group.pg)
    return x


def broadcast_object(obj: object, group: Group, src_index: int = 0) -> object:
    """Group member `src_index`'s picklable `obj` on every member (the others' obj is ignored).

    For small control messages (a serving step's plan), not tensors: it pickles and makes
    two broadcasts (size, then bytes)."""
    if group.size == 1:
        return obj
    _count(group, "broadcast_object")
    box = [obj]
    dist.broadcast_object_list(box, src=group.ranks[src_index], group=group.pg)
    return box[0]
