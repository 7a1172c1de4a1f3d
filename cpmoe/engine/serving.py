"""The engine side of `cpmoe serve`: the rank task, and rank 0's link to the HTTP process.

Link messages (a `multiprocessing.connection`), HTTP process -> rank 0: ("add", Request),
("cancel", rid), ("stop",). Rank 0 -> HTTP process: ("ready", rank_pids, sizes) once every
rank has loaded the model and sized its KV cache (sizes: kv_capacity, graph_bytes), then
one ("step", [TokenEvent], stats) per step, and one per idle tick.
While idle, rank 0 still broadcasts an empty plan every `idle_tick_s`, so the other ranks,
waiting in that broadcast, never reach the collective timeout.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from pathlib import Path

import torch

from cpmoe.engine.engine import Driver, Frontend, engine_loop
from cpmoe.engine.options import EngineOptions, prepare_runner, radix_cache
from cpmoe.engine.generate import generate
from cpmoe.engine.grammar import GrammarBackend
from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import TokenEvent
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class EngineSpec:
    model_dir: Path
    layout: ParallelLayout
    dtype: torch.dtype
    eos_ids: tuple[int, ...]
    link_address: tuple[str, int]
    link_authkey: bytes
    options: EngineOptions = field(default_factory=EngineOptions)
    default_kv_tokens: int = 16384  # KV slots per rank on CPU without --max-total-tokens
    idle_tick_s: float = 0.5
    ignore_sigterm: bool = True  # pool ranks; torchrun workers keep the agent's SIGTERM


class LinkFrontend(Frontend):
    def __init__(self, spec: EngineSpec, rank_pids: list[int], sizes: dict) -> None:
        self.conn: Connection = Client(spec.link_address, authkey=spec.link_authkey)
        self.conn.send(("ready", rank_pids, sizes))

    def poll(self, timeout: float) -> list[tuple]:
        msgs = []
        while self.conn.poll(timeout):
            msgs.append(self.conn.recv())
            timeout = 0.0
        return msgs

    def emit(self, events: list[TokenEvent], stats: dict) -> None:
        self.conn.send(("step", events, stats))


WARM_UP_PROMPTS = (16, 100)  # tokens of the warm-up batch's prompts
WARM_UP_TOKENS = 4  # tokens each generates


def warm_up_serving(runner: ModelRunner, opts: EngineOptions) -> None:
    """Every rank: one short batch through the engine loop (scheduler, sampling, the
    overlapped steps, decode graphs) before the server says it is ready, its KV freed
    again. The runner's warm-up covers the forward's kernels; this covers what only a
    served step launches, which the first requests would otherwise wait on (a server's
    first step took 1.0 s against 0.2 s for the next server on the same machine). SGLang
    sends its own server a request likewise."""
    vocab = runner.config.vocab_size
    prompts = [[(i * 7919 + n) % vocab for i in range(n)] for n in WARM_UP_PROMPTS]
    generate(runner, prompts, WARM_UP_TOKENS, options=opts)


def serve_task(info: RankInfo, spec: EngineSpec) -> None:
    # A SIGTERM to the whole process group (systemd, `timeout`) is the server's to handle: it
    # stops this loop cleanly. The pool's own aborts escalate to SIGKILL anyway.
    if spec.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups = ProcessGroups.build(spec.layout, info.rank, info.device)
    runner = ModelRunner(spec.model_dir, groups, spec.dtype, show_progress=False,
                         load_format=spec.options.load_format,
                         quantization=spec.options.quantization)
    sizes = prepare_runner(runner, spec.options, spec.default_kv_tokens)
    warm_up_serving(runner, spec.options)
    pid = torch.tensor([os.getpid()], dtype=torch.int64, device=runner.device)
    pids = [int(p) for p in runner.gather_from_ranks(pid)]
    driver = None
    if info.rank == 0:
        opts = spec.options
        sched = Scheduler(runner.kv, spec.layout.cp_strategy, opts.chunked_prefill_size,
                          opts.max_running_requests, spec.eos_ids,
                          radix=radix_cache(runner, opts),
                          policy=opts.schedule_policy)
        # the grammar backend first: the server reports ready once the frontend links up
        grammars = GrammarBackend(spec.model_dir, runner.config.vocab_size, spec.eos_ids,
                                  pin_memory=runner.device.type == "cuda")
        frontend = LinkFrontend(spec, pids, sizes)
        driver = Driver(runner, sched, frontend, spec.idle_tick_s,
                        overlap=not opts.disable_overlap_schedule, grammars=grammars)
    try:
        engine_loop(runner, driver)
    finally:
        if driver is not None:
            frontend.conn.close()
            grammars.close()
