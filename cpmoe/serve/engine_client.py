"""The HTTP server's handle on the engine ranks.

Threads of the server process:
- the event loop (uvicorn): `submit` and `cancel` send on the link; every token reaches its
  request through that request's asyncio queue;
- the pool thread: `RankPool.run(engine_loop_task)`, which returns only when the engine stops
  (or raises `RankFailure` within about a second of a rank dying);
- the link thread: accepts rank 0's connection and hands each step's tokens to the loop.

Invariants:
- After a failure every waiting request receives `None` (-> `EngineDown`) and every later
  `submit` raises `EngineDown`; `failure` keeps the root error for the exit message.
- `waiting` counts requests accepted but without a first token; `submit` refuses
  (`QueueFull`) once it reaches `max_queue`.
- A cancelled or finished request leaves `_streams`, so late tokens for it are dropped.
- Once the server stops (`abort_all`), every running request ends with finish "abort" and
  later `submit`s raise `EngineDown`; steps that arrive after the event loop closed are
  dropped (nobody reads them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener

from cpmoe.engine.profiler import ProfileCommand
from cpmoe.engine.request import Request, TokenEvent
from cpmoe.engine.serving import EngineSpec, serve_task
from cpmoe.parallel.launch import RankInfo, RankPool
from cpmoe.serve.metrics import BatchLog, Metrics
from cpmoe.serve.jobs import Job


class EngineDown(RuntimeError):
    pass


class QueueFull(RuntimeError):
    pass


ABORTED = "abort"  # what a stream's queue holds when the server stops under it


@dataclass
class RequestStream:
    rid: int
    prompt_tokens: int
    cached_tokens: int = 0  # of the prompt, from the prefix cache (known once finished)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None

    async def next(self) -> TokenEvent | None:
        """The next token, or None once the server aborted the request (it is stopping)."""
        event = await self.queue.get()
        if event is None:
            raise EngineDown("the engine failed")
        return None if event == ABORTED else event


class EngineClient:
    def __init__(self, spec: EngineSpec, pool: RankPool | None, listener: Listener,
                 max_queue: int, metrics: Metrics, on_failure: Callable[[], None],
                 world: RankInfo | None = None, batch_log: BatchLog | None = None) -> None:
        self.spec, self.pool, self.max_queue, self.metrics = spec, pool, max_queue, metrics
        self.batch_log = batch_log
        self._listener = listener
        self._on_failure = on_failure
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[int, RequestStream] = {}
        self._next_rid = 0
        self._stopping = False  # the engine was told to stop
        self._draining = False  # the server stops: no new requests
        self.failure: BaseException | None = None
        self.sizes: dict = {}  # the engine's kv_capacity (token slots per rank), graph_bytes
        self._world = world  # torchrun: this process is rank 0 of that world, no pool
        self._pool_thread = threading.Thread(target=self._run_pool, name="cpmoe-engine",
                                             daemon=True)

    @classmethod
    def start(cls, spec: EngineSpec, world_size: int, device: str, max_queue: int,
              metrics: Metrics, on_failure: Callable[[], None],
              world: RankInfo | None = None, batch_log: BatchLog | None = None
              ) -> EngineClient:
        """Spawn the ranks (or, with `world`, run rank 0 of a torchrun world in a thread of
        this process), start the engine and wait until the model is loaded on all ranks;
        raises the engine's failure (RankFailure) if it dies first."""
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        spec = dataclasses.replace(spec, link_address=listener.address, link_authkey=authkey)
        pool = None if world else RankPool(world_size, device, collective_timeout_s=120.0)
        self = cls(spec, pool, listener, max_queue, metrics, on_failure, world, batch_log)
        self._pool_thread.start()
        threading.Thread(target=self._read_link, name="cpmoe-link", daemon=True).start()
        self._ready.wait()
        if self.failure is not None:
            raise self.failure
        return self

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that requests live on (set once the server runs)."""
        self._loop = loop

    @property
    def alive(self) -> bool:
        return self.failure is None and not (self._stopping or self._draining)

    # ---- event loop side ---------------------------------------------------------------------
    def submit(self, job: Job, arrived: float | None = None) -> RequestStream:
        """`arrived`: when the HTTP request came in (time.monotonic); its wait until now is
        the request's intake time."""
        if not self.alive:
            raise EngineDown("the engine is not running")
        if self.metrics.waiting >= self.max_queue:
            raise QueueFull(f"{self.metrics.waiting} requests already wait (--max-queue "
                            f"{self.max_queue}); retry later")
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        stream = RequestStream(rid, len(job.prompt_ids))
        if arrived is not None:
            self.metrics.intake.observe(stream.arrived - arrived)
            stream.arrived = arrived
        self._streams[rid] = stream
        self.metrics.waiting += 1
        self._send(("add", Request(rid, job.prompt_ids, job.params, job.max_tokens,
                                   stream=job.index, ignore_eos=job.ignore_eos,
                                   kv_need=job.kv_need, logprobs=job.logprobs,
                                   stop_ids=job.stop_token_ids, grammar=job.grammar,
                                   prompt_logprobs=job.logprobs if job.prompt_logprobs
                                   else None)))
        return stream

    def abort_all(self) -> int:
        """The server stops: end every running request with finish "abort" (each is then
        released, which cancels it on the engine) and refuse new ones -> how many."""
        self._draining = True
        for stream in self._streams.values():
            stream.queue.put_nowait(ABORTED)
        return len(self._streams)

    def profile(self, cmd: ProfileCommand) -> None:
        """Open (or close) a profiler window on every rank from the engine's next step."""
        if not self.alive:
            raise EngineDown("the engine is not running")
        self._send(("profile", cmd))

    def release(self, stream: RequestStream, reason: str) -> None:
        """The server is done with a request: tell the engine to drop it if it still runs."""
        if self._streams.pop(stream.rid, None) is None:
            return  # finished on the engine already
        if stream.first is None:
            self.metrics.waiting -= 1
        self.metrics.finished[reason] += 1
        if self.failure is None:
            self._send(("cancel", stream.rid))

    def _send(self, msg: tuple) -> None:
        assert self._conn is not None
        try:
            with self._send_lock:
                self._conn.send(msg)
        except OSError:  # rank 0 is gone; the pool thread reports why
            pass

    def _on_step(self, events: list[TokenEvent], stats: dict) -> None:
        now = time.monotonic()
        m = self.metrics
        m.on_step(stats)
        if self.batch_log is not None:
            self.batch_log.on_step(stats, len(events), m.kv_capacity)
        for ev in events:
            stream = self._streams.get(ev.rid)
            if stream is None:
                continue
            if stream.first is None:
                stream.first = now
                m.waiting -= 1
                m.ttft.observe(now - stream.arrived)
            else:
                m.itl.observe(now - (stream.last or now))
            stream.last = now
            m.generation_tokens += 1
            if ev.finish is not None:
                stream.cached_tokens = ev.cached_tokens or 0
                del self._streams[ev.rid]
                m.finished[ev.finish] += 1
                m.e2e.observe(now - stream.arrived)
            stream.queue.put_nowait(ev)

    def _fail_all(self) -> None:
        self.metrics.engine_up = False
        for stream in self._streams.values():
            stream.queue.put_nowait(None)
            self.metrics.finished["error"] += 1
        self._streams.clear()
        self.metrics.waiting = 0

    # ---- threads -----------------------------------------------------------------------------
    def _run_pool(self) -> None:
        try:
            if self.pool is not None:
                self.pool.run(serve_task, self.spec)
            else:
                assert self._world is not None
                serve_task(self._world, self.spec)
            if not self._stopping:
                raise EngineDown("the engine loop ended without being asked to")
        except BaseException as err:  # noqa: BLE001  (reported to the server, then re-raised)
            self.failure = err
            self.metrics.engine_up = False
            self._ready.set()
            self._post(self._fail_all)
            self._on_failure()

    def _read_link(self) -> None:
        try:
            self._conn = self._listener.accept()
            while True:
                msg = self._conn.recv()
                if msg[0] == "ready":
                    self.metrics.rank_pids = list(msg[1])
                    self.sizes = dict(msg[2])
                    self.metrics.kv_capacity = self.sizes["kv_capacity"]
                    self.metrics.engine_up = True
                    self._ready.set()
                elif msg[0] == "step":
                    self._post(self._on_step, msg[1], msg[2])
        except (EOFError, OSError):
            return  # rank 0 ended: the pool thread knows why

    def _post(self, fn: Callable, *args: object) -> None:
        """Run fn(*args) on the event loop, if one runs: before it starts and after it closed
        (a stopping server) there is no request left to tell."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed meanwhile (checking first would race the close)
            pass

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine loop on every rank and close the pool (idempotent). An engine that
        does not stop in time is left to the ranks' own watchdog: they exit with this process."""
        if self.failure is None and not self._stopping:
            self._stopping = True
            self._send(("stop",))
        self._pool_thread.join(timeout_s)
        if not self._pool_thread.is_alive() and self.pool is not None:
            self.pool.close()
        self._listener.close()
