"""`cpmoe serve`: bind the port, start the engine ranks, run uvicorn until told to stop.

Order: the HTTP socket is bound first (a taken port fails before any rank is spawned), then
the ranks load the model, then the server accepts requests; the line
"cpmoe: serving <model> at http://HOST:PORT" on stderr says it is ready.

Exit: 0 after SIGINT/SIGTERM, with one line on stderr: running requests end at once with
finish_reason "abort" (streams get their last chunk and [DONE]), new ones get 503, then the
engine loop is stopped and the ranks leave cleanly. When a
rank fails, requests get 503 for `FAILURE_GRACE_S` (so in-flight clients and health checks
learn why), then the server stops and the root error (`RankFailure`) propagates to the CLI,
which prints it and exits 1.

Under torchrun (`serve_in_world`) every worker is a rank: rank 0 serves HTTP with engine rank
0 in a thread of its process; a dead peer fails rank 0's next collective, with the same 503s
and exit 1.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import torch
import uvicorn

from cpmoe.engine.options import EngineOptions
from cpmoe.engine.serving import EngineSpec, serve_task
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout
from cpmoe.serve.app import ServeState, build_app
from cpmoe.serve.engine_client import EngineClient
from cpmoe.serve.metrics import BatchLog, Metrics
from cpmoe.serve.options import BindError, ServeOptions
from cpmoe.serve.jobs import Limits

FAILURE_GRACE_S = 1.0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BindError(f"--host {host} --port {port}: cannot bind ({e.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class _Exit:
    """Stops uvicorn FAILURE_GRACE_S after the engine fails (called from the pool thread)."""

    def __init__(self) -> None:
        self.server: uvicorn.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.failed = False

    def on_loop_ready(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        if self.failed:
            self._schedule()

    def on_failure(self) -> None:
        self.failed = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._schedule)

    def _schedule(self) -> None:
        assert self.loop is not None and self.server is not None
        server = self.server
        self.loop.call_later(FAILURE_GRACE_S, lambda: setattr(server, "should_exit", True))


class _Server(uvicorn.Server):
    """uvicorn's server, which also ends the running requests on the first SIGINT/SIGTERM:
    otherwise its graceful shutdown waits for long streams, then cuts them mid-response."""

    def __init__(self, config: uvicorn.Config, client: EngineClient, exit_: _Exit) -> None:
        super().__init__(config)
        self.client, self.exit_ = client, exit_

    def handle_exit(self, sig: int, frame: object) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        loop = self.exit_.loop
        if first and loop is not None:  # a signal handler must not touch the loop's queues
            loop.call_soon_threadsafe(self._abort, sig)

    def _abort(self, sig: int) -> None:
        n = self.client.abort_all()
        print(f"cpmoe: {signal.Signals(sig).name}: stopping ({n} running request(s) aborted)",
              file=sys.stderr, flush=True)


def serve_in_world(info: RankInfo, opts: ServeOptions, engine: EngineOptions,
                   layout: ParallelLayout, model_dir: Path, cfg, context: int, device: str,
                   dtype: torch.dtype, tokenizer) -> int:
    """One rank of a torchrun world (`launch` joined it): rank 0 serves HTTP and runs engine
    rank 0 in a thread; every other rank runs the engine loop until rank 0 stops it."""
    if info.rank == 0:
        return serve(opts, engine, layout, model_dir, cfg, context, device, dtype, tokenizer,
                     info)
    # SIGTERM is rank 0's to handle (it stops every rank's loop); a rank whose peers vanish
    # fails its next collective anyway
    serve_task(info, _spec(model_dir, layout, dtype, cfg, engine))
    return 0


def _spec(model_dir: Path, layout: ParallelLayout, dtype: torch.dtype, cfg,
          engine: EngineOptions, ignore_sigterm: bool = True) -> EngineSpec:
    return EngineSpec(model_dir, layout, dtype, tuple(cfg.eos_token_ids), ("127.0.0.1", 0), b"",
                      engine, ignore_sigterm=ignore_sigterm)


def serve(opts: ServeOptions, engine: EngineOptions, layout: ParallelLayout, model_dir: Path,
          cfg, context: int, device: str, dtype: torch.dtype, tokenizer,
          world: RankInfo | None = None) -> int:
    """`context`: the context length every request must fit (prompt + max_tokens).
    `world`: rank 0 of a torchrun world (engine rank 0 runs in a thread of this process)."""
    sock = bind(opts.host, opts.port)
    host, port = sock.getsockname()[:2]
    name = opts.served_model_name or model_dir.name
    metrics = Metrics()
    exit_ = _Exit()
    spec = _spec(model_dir, layout, dtype, cfg, engine, ignore_sigterm=world is None)
    client = EngineClient.start(spec, layout.world_size, device, opts.max_queue, metrics,
                                exit_.on_failure, world, BatchLog(opts.decode_log_interval))
    try:
        limits = Limits(name, cfg.vocab_size, context,
                        client.sizes["kv_capacity"],
                        client.sizes.get("kv_cp_size", layout.attn_cp_size), layout.cp_strategy,
                        opts.default_max_tokens, engine.page_size, engine.chunked_prefill_size,
                        opts.tool_call_parser, opts.reasoning_parser)
        app = build_app(ServeState(client, tokenizer, limits, metrics, _attach(client, exit_)))
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=5), client, exit_)
        exit_.server = server
        print(f"cpmoe: serving {name} at http://{host}:{port} ({layout.world_size} rank(s), "
              f"pids {metrics.rank_pids})", file=sys.stderr, flush=True)
        _run_until_signal(server, sock)
    finally:
        client.shutdown()
        sock.close()
    if client.failure is not None:
        raise client.failure
    return 0


class _Stopped(Exception):
    pass


def _stop(sig: int, frame: object) -> None:
    raise _Stopped(sig)


def _run_until_signal(server: uvicorn.Server, sock: socket.socket) -> None:
    """uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    found at its start: ours turns that into a normal return (exit 0 after cleanup)."""
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _attach(client: EngineClient, exit_: _Exit):
    def ready(loop: asyncio.AbstractEventLoop) -> None:
        client.attach(loop)
        exit_.on_loop_ready(loop)
    return ready
