"""`cpmoe serve` under torchrun: two "nodes" on this host (`--nnodes 2 --nproc-per-node 2`,
gloo) make ONE server: rank 0 serves HTTP, all four ranks run the engine. Its completion
equals `cpmoe generate` on the same layout, a worker killed on the second node brings the
server down (503 to clients, exit 1) within 30 s, and SIGTERM to rank 0 stops every rank
cleanly (both torchrun launchers exit 0). The SIGTERM case runs one rank per node (tp 2):
the stop crosses nodes as at four ranks, for two rank interpreters and their torch imports
less.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

from tests.e2e._serve_helpers import Server

LAYOUT = ("--tp-size", "4", "--attn-cp-size", "2", "--moe-dp-size", "1", "--ep-size", "4")
TP2 = ("--tp-size", "2", "--attn-cp-size", "2", "--ep-size", "2")
PROMPT = "Context parallel prefill"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(node_rank: int, port: int, per_node: int) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", str(per_node), "--node-rank", str(node_rank), "--master-addr",
            "127.0.0.1", "--master-port", str(port), "-m", "cpmoe.cli")


def _launch_two_nodes(tmp_path_factory, seed_cache, layout: tuple[str, ...] = LAYOUT,
                      per_node: int = 2) -> tuple[Path, list[Server]]:
    cache = tmp_path_factory.mktemp("cpmoe-cache")
    work = tmp_path_factory.mktemp("torchrun")
    seed_cache(cache)  # the built-in model there before the ranks look for it
    port = _free_port()
    flags = (*layout, "--max-total-tokens", "2048")
    return cache, [Server(work, cache, *flags, launcher=_torchrun(r, port, per_node))
                   for r in (0, 1)]


def _stop_all(nodes: list[Server]) -> None:
    for node in nodes:
        node.stop()
    for node in nodes:
        for pid in node.processes():
            os.kill(pid, signal.SIGKILL)


def test_torchrun_server_stops_every_rank_cleanly_on_sigterm_to_rank_0(tmp_path_factory,
                                                                      default_model_cache):
    _, nodes = _launch_two_nodes(tmp_path_factory, default_model_cache, TP2, per_node=1)
    try:
        server = nodes[0].wait_ready(timeout_s=300)
        pids = server.health()["rank_pids"]
        assert len(pids) == 2  # one on each node
        os.kill(pids[0], signal.SIGTERM)
        for node in nodes:
            assert node.proc.wait(timeout=60) == 0, node.stderr()
    finally:
        _stop_all(nodes)


def test_torchrun_two_nodes_serve_one_server_equal_to_generate_and_die_together(
        tmp_path_factory, default_model_cache, demo_sampled_generate):
    _, nodes = _launch_two_nodes(tmp_path_factory, default_model_cache)
    try:
        server = nodes[0].wait_ready(timeout_s=300)
        pids = server.health()["rank_pids"]
        assert len(pids) == 4
        want = demo_sampled_generate  # `cpmoe generate` on LAYOUT (tests/e2e/conftest.py)
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                        timeout=300)
        resp = client.completions.create(model=server.model, prompt=want.prompt,
                                         max_tokens=want.max_new_tokens,
                                         temperature=want.temperature, top_p=want.top_p,
                                         seed=want.seed, extra_body={"top_k": want.top_k,
                                                                     "return_token_ids": True})
        assert resp.choices[0].token_ids == want.tokens

        body = {"model": server.model, "prompt": "in flight", "max_tokens": 400,
                "stream": True, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as inflight:
                lines = inflight.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                killed_at = time.monotonic()
                os.kill(pids[3], signal.SIGKILL)  # a worker of the second node
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest and "engine_down" in rest[-1] and "[DONE]" not in rest[-1]
            try:  # rank 0 answers 503 until it exits (torchrun may stop it sooner)
                r = http.post("/v1/completions", json={**body, "stream": False})
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
            except httpx.TransportError:
                pass
        deadline = killed_at + 30
        code = server.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert code == 1, server.stderr()
        assert time.monotonic() - killed_at < 30
        assert nodes[1].proc.wait(timeout=30) != 0
    finally:
        _stop_all(nodes)
