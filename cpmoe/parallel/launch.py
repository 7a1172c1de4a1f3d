"""Local multi-process launching with a reusable torch.distributed world.

Invariants:
- A ``RankPool`` owns ``world_size`` spawned daemon ranks in one process group (gloo on cpu, nccl
  on cuda with device ``cuda:<rank>``), rendezvoused through a TCPStore the parent hosts on a port
  bound at run time (127.0.0.1, port 0): no port race, and the store outlives any rank.
- Fail fast: the first rank to raise or die kills the pool (SIGTERM, SIGKILL after a short grace,
  all reaped) and ``run`` raises ``RankFailure`` for it within about a second, never waiting for
  peers stuck in a collective.  A dead pool never runs again.
- No orphans: ranks exit on close, on GC, at interpreter exit (weakref.finalize) and, through a
  watchdog thread, when the pool's owner disappears (the end of a pipe only the owner holds).
- How ranks start: on cuda, 'spawn' (a fresh interpreter; a CUDA context must never be
  forked). On cpu, 'forkserver': one server process per owner, started with SIGINT ignored,
  imports torch once (``_FORKSERVER_PRELOAD``) and forks every rank from that, so a rank costs
  no interpreter start and no torch import (about 2.5 CPU-s each with 'spawn'). It never
  touches CUDA, holds no threads when forking, and exits with the owner (multiprocessing's
  'alive' pipe: once the owner and all ranks are gone). Either way a script creating a pool
  must guard it with ``if __name__ == "__main__"``.
- The rank body starts from the owner's environment at pool creation (a forked rank inherits
  the server's, which is older: ``_worker_main`` replaces it), then applies ``env`` overrides,
  i.e. after ``import torch``. What a library reads at import (OpenMP's OMP_* variables) is
  the owner's environment when it started its forkserver; torch threads are set per rank.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpmoe.parallel.cpus import set_cpu_threads
from cpmoe.parallel.failures import (RankFailure, failure, report_failure, unpickled)

_POLL_S = 0.1  # parent wake-up period when nothing happens (a death wakes it at once anyway)
_KILL_GRACE_S = 0.5  # SIGTERM -> SIGKILL grace when aborting
_CLOSE_GRACE_S = 10.0  # time ranks get to leave the process group on a clean close
_STARTUP_EXTRA_S = 120.0  # interpreter + torch import on a loaded machine, before rendezvous
_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
# What a cpu rank imports before its task: the forkserver imports it once, each rank is a fork
# of that. Only third-party modules that read no environment at import (a rank's environment
# is applied after the fork), and no cpmoe module: Python 3.11's forkserver imports with its
# own sys.path (cwd, PYTHONPATH, site-packages), not the owner's, so it could find another
# cpmoe (an installed one, where the owner runs a checkout). cpmoe and the task modules
# import in the rank after multiprocessing set the owner's sys.path: ~0.1-0.3 CPU-s.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed"]


@dataclass(frozen=True)
class RankInfo:
    """Who this rank is; the first argument of every task function."""

    rank: int
    world_size: int
    device: torch.device  # cuda:<local_rank> on cuda, cpu otherwise


def _device_type(device: str) -> str:
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return kind


def _rank_device(kind: str, local_rank: int) -> torch.device:
    return torch.device(kind, local_rank if kind == "cuda" else None)


def torchrun_rank() -> int | None:
    """This process's global rank when torchrun (or any env:// launcher) started it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


@contextlib.contextmanager
def _sigint_ignored():
    """Start ranks with SIGINT ignored. Ctrl-C reaches the whole process group, and a rank
    still starting up (importing, before `_worker_main` ignores it) would print a
    KeyboardInterrupt traceback; an ignored signal stays ignored across exec, and Python then
    installs no KeyboardInterrupt handler. The parent stops the ranks itself. On cpu the
    forkserver starts under it (its forks inherit the ignored signal) and the parent waits
    for the forks with SIGINT live. (Only the main thread may change signal handlers; a pool
    made elsewhere keeps the old behaviour.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _watch_owner(owner: Connection) -> None:
    # A rank busy in a task does not read its task pipe. Only the owner holds the other end
    # of `owner` (a forked rank's parent is the forkserver, so getppid() cannot tell): EOF
    # means it closed the pool or died.
    with contextlib.suppress(Exception):
        owner.poll(None)
    os._exit(1)


def _context(kind: str) -> Any:
    """The multiprocessing context ranks of this device kind start from (module docstring)."""
    if kind == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # no effect once the server runs
    return ctx


def _worker_main(rank: int, world_size: int, kind: str, port: int, timeout_s: float,
                 owner_env: dict[str, str], env: dict[str, str], owner: Connection,
                 tasks: Connection, results: Connection) -> None:
    """Entry point of a pool rank: join the group, then run tasks until told to exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's job: it kills us
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # parent dumps stacks on hang
    if os.environ != owner_env:  # a forked rank: the forkserver's environment is older
        os.environ.clear()
        os.environ.update(owner_env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}, **env)
    with contextlib.suppress(Exception):  # a rank's prints show live, not at its exit
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    threading.Thread(target=_watch_owner, args=(owner,), daemon=True).start()
    try:
        if kind == "cuda":
            torch.cuda.set_device(rank)
        set_cpu_threads(world_size, kind)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
        dist.init_process_group(_BACKEND[kind], store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        info = RankInfo(rank, world_size, _rank_device(kind, rank))
    except BaseException as err:
        report_failure(results, err)
    results.send(("ready", 0, None))
    while True:
        try:
            msg = tasks.recv()
        except EOFError:  # the parent closed the pipe or died: nobody wants results any more
            break
        if msg[0] == "exit":
            break
        try:
            fn, args, kwargs = pickle.loads(msg[2])
            out = pickle.dumps(fn(info, *args, **kwargs), pickle.HIGHEST_PROTOCOL)
        except BaseException as err:
            report_failure(results, err)
        results.send(("ok", msg[1], out))
    dist.destroy_process_group()  # then multiprocessing flushes stdio and exits with code 0


@dataclass
class _PoolState:
    """Everything a pool owns, kept apart from RankPool so a finalizer can close it after GC."""

    procs: list[Any] = field(default_factory=list)
    tasks: list[Connection] = field(default_factory=list)  # parent -> rank
    results: list[Connection] = field(default_factory=list)  # rank -> parent
    owner: Connection | None = None  # write end the ranks watch (_watch_owner); never written
    store: dist.TCPStore | None = None
    dead: bool = False

    def shutdown(self, graceful: bool = True) -> None:
        """Idempotent. graceful: ranks leave the group; else SIGTERM. Stragglers get SIGKILL."""
        live = [p for p in self.procs if p.exitcode is None]
        if graceful and not self.dead:
            for conn in self.tasks:
                with contextlib.suppress(OSError):  # a rank already gone is reaped below
                    conn.send(("exit",))
        else:
            for p in live:
                p.terminate()
        self.dead = True
        deadline = time.monotonic() + (_CLOSE_GRACE_S if graceful else _KILL_GRACE_S)
        for p in live:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
            p.join()  # reap: no zombies left behind
        for conn in self.tasks + self.results + ([self.owner] if self.owner else []):
            conn.close()
        self.tasks, self.results, self.owner, self.store = [], [], None, None


class RankPool:
    """world_size ranks (started as the module docstring says) in one torch.distributed world,
    reused across tasks."""

    def __init__(self, world_size: int, device: str = "cpu", *, collective_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.device = world_size, _device_type(device)
        self._lock = threading.Lock()
        self._next_task = 1
        self._state = state = _PoolState()
        self._finalizer = weakref.finalize(self, state.shutdown)  # GC and interpreter exit
        state.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=collective_timeout_s))
        ctx = _context(self.device)
        forked = ctx.get_start_method() == "forkserver"
        owner_r, state.owner = ctx.Pipe(duplex=False)
        owner_env = dict(os.environ)
        try:
            if forked:  # the server's ranks inherit its ignored SIGINT, and it imports torch
                with _sigint_ignored():  # without a KeyboardInterrupt traceback
                    forkserver.ensure_running()  # (returns at once; start() waits for it)
            for rank in range(world_size):
                task_r, task_w = ctx.Pipe(duplex=False)
                res_r, res_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker_main, name=f"cpmoe-rank{rank}", daemon=True,
                    args=(rank, world_size, self.device, state.store.port, collective_timeout_s,
                          owner_env, dict(env or {}), owner_r, task_r, res_w))
                with contextlib.nullcontext() if forked else _sigint_ignored():
                    proc.start()  # forked: Ctrl-C while the server imports torch stops us
                task_r.close()  # drop the parent's copies of the child's ends so that
                res_w.close()  # a dead rank reads as EOF
                state.procs.append(proc)
                state.tasks.append(task_w)
                state.results.append(res_r)
            owner_r.close()  # the ranks hold it now; the owner keeps only the write end
            self._collect("ready", 0, time.monotonic() + collective_timeout_s + _STARTUP_EXTRA_S)
        except BaseException:
            owner_r.close()  # idempotent
            state.shutdown(graceful=False)
            raise

    @property
    def alive(self) -> bool:
        return not self._state.dead and all(p.exitcode is None for p in self._state.procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run fn(info, *args, **kwargs) on every rank; return per-rank results (index = rank)."""
        # Pickle here, not in the ranks, so an unpicklable task fails cleanly and the pool lives.
        payload = pickle.dumps((fn, args, kwargs), pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._state.dead:  # (a rank that died idle is reported by _collect instead)
                raise RuntimeError("rank pool is closed (closed by its owner or killed after a "
                                   "rank failure); create a new RankPool")
            task_id, self._next_task = self._next_task, self._next_task + 1
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            try:
                for conn in self._state.tasks:
                    with contextlib.suppress(OSError):  # a rank died idle: _collect reports it
                        conn.send(("task", task_id, payload))
                return self._collect("ok", task_id, deadline)
            except BaseException:  # RankFailure, KeyboardInterrupt, ...: no half-alive pool
                self._state.shutdown(graceful=False)
                raise

    def _collect(self, kind: str, task_id: int, deadline: float | None) -> list[Any]:
        state, results, pending = self._state, [None] * self.world_size, set(range(self.world_size))
        while pending:
            wait([state.results[r] for r in pending] + [p.sentinel for p in state.procs],
                 timeout=_POLL_S)
            errors: list[tuple[float, int, str, str, bytes | None]] = []
            deaths: list[int] = []
            for rank, (proc, conn) in enumerate(zip(state.procs, state.results)):
                # Judge the exit only after draining: a rank's traceback precedes its death.
                exited = proc.exitcode is not None
                try:
                    while conn.poll():
                        msg = conn.recv()
                        if msg[0] == "error":
                            errors.append((msg[3], rank, msg[1], msg[2], msg[4]))
                        elif msg[0] == kind and msg[1] == task_id:
                            results[rank] = None if msg[2] is None else pickle.loads(msg[2])
                            pending.discard(rank)
                except (EOFError, OSError):
                    exited = True
                if exited and all(e[1] != rank for e in errors):
                    deaths.append(rank)
            if deaths:  # a silent death (signal, os._exit) is the root: peers' errors follow it
                state.procs[deaths[0]].join(timeout=1.0)
                code = state.procs[deaths[0]].exitcode  # death by signal N reads as -N
                sig = {-s.value: f" ({s.name})" for s in signal.Signals}.get(code or 0, "")
                raise RankFailure(deaths[0], f"rank {deaths[0]} died: exit code {code}{sig}")
            if errors:
                _, rank, headline, tb, err = min(errors, key=lambda e: e[:2])  # earliest
                raise RankFailure(rank, f"rank {rank} failed: {headline}", tb, unpickled(err))
            if deadline is not None and time.monotonic() > deadline:
                for rank in pending:  # a hang is a bug: faulthandler prints each rank's stacks
                    with contextlib.suppress(OSError, AttributeError):  # gone, or no SIGUSR1
                        os.kill(state.procs[rank].pid, signal.SIGUSR1)
                time.sleep(0.5)
                what = "did not start" if kind == "ready" else "task did not finish"
                raise RankFailure(min(pending), f"rank {min(pending)} timed out: {what} in time "
                                                f"(unfinished ranks: {sorted(pending)})")
        return results

    def close(self) -> None:
        """Idempotent: ranks leave the process group and exit; stragglers are killed."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(fn: Callable[..., Any], world_size: int, device: str, *args: Any,
           collective_timeout_s: float = 600.0, **kwargs: Any) -> Any:
    """Run fn(info, *args, **kwargs) for a CLI command; return this rank's (or rank 0's) result.
    collective_timeout_s bounds how long a rank waits in one collective for its peers (a
    rank that dies ends the job at once anyway; this only catches peers that stall).
    Under torchrun this process is one rank: an exception of fn is raised as this rank's
    RankFailure (`error` = the exception), as a pool raises it."""
    kind = _device_type(device)
    if torchrun_rank() is not None:  # started by torchrun: join it
        if (env_world := int(os.environ["WORLD_SIZE"])) != world_size:
            raise ValueError(f"launched with WORLD_SIZE={env_world} (torchrun) but the command "
                             f"asks for world_size={world_size}; make them match")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), kind)
        if kind == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(_BACKEND[kind], init_method="env://", rank=rank,
                                world_size=world_size)
        try:
            return fn(RankInfo(rank, world_size, _rank_device(kind, local_rank)), *args, **kwargs)
        except Exception as err:  # noqa: BLE001  (re-raised as RankFailure, as from a pool)
            raise failure(rank, err) from None
        finally:
            dist.destroy_process_group()  # a clean exit: NCCL warns about undestroyed groups
    if world_size == 1:  # no process group: single-rank code paths must not need one
        set_cpu_threads(1, kind)
        return fn(RankInfo(0, 1, _rank_device(kind, 0)), *args, **kwargs)
    with RankPool(world_size, kind, collective_timeout_s=collective_timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)[0]
