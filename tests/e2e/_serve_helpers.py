"""Helpers for test_serve.py: a `cpmoe serve` subprocess and per-prompt reference tokens.

`Server` starts the real CLI (`python -m cpmoe.cli serve --device cpu --port 0`), reads the
bound address from its "serving ... at http://HOST:PORT" stderr line and waits for /health.
stdout/stderr go to files (no pipe to fill up). Every process it starts carries
`CPMOE_E2E_MARKER=<id>` in its environment, so `processes()` finds them (ranks included).

`Reference` runs `cpmoe.engine.generate.generate` in this process on one rank with ONE prompt,
which is what `cpmoe generate --prompts-file` does for a one-prompt file; the server's
tokens for the same prompt and seed must equal it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sampling import SamplingParams
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.serve.metrics import parse_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_LINE = re.compile(r"cpmoe: serving (\S+) at (http://\S+) ")


class Server:
    def __init__(self, workdir: Path, cache_dir: Path, *flags: str,
                 env: dict[str, str] | None = None,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "cpmoe.cli")) -> None:
        self.marker = uuid.uuid4().hex
        self.err_path = workdir / f"serve-{self.marker}.err"
        self.flags = flags
        full_env = {**os.environ, **(env or {}), "CPMOE_CACHE_DIR": str(cache_dir),
                    "CPMOE_E2E_MARKER": self.marker,
                    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT),
                                                   os.environ.get("PYTHONPATH", "")])}
        with open(self.err_path, "wb") as err, open(workdir / f"serve-{self.marker}.out",
                                                     "wb") as out:
            self.proc = subprocess.Popen(
                [*launcher, "serve", "--device", "cpu", "--port", "0", *flags], env=full_env,
                cwd=str(REPO_ROOT), stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        self.url = ""
        self.model = ""

    def wait_ready(self, timeout_s: float = 180.0) -> Server:
        deadline = time.monotonic() + timeout_s
        while not self.url:
            m = READY_LINE.search(self.stderr())
            if m:
                self.model, self.url = m[1], m[2]
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.stderr()}")
            time.sleep(0.1)
        while httpx.get(f"{self.url}/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("/health never answered 200")
            time.sleep(0.1)
        return self

    def stderr(self) -> str:
        return self.err_path.read_bytes().decode("utf-8", errors="replace")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Metrics once no request waits or runs and no rank holds KV (or the last seen)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            used = [v for k, v in m.items() if k.startswith("cpmoe_kv_slots_used{")]
            idle = (m["cpmoe_requests_waiting"] == 0 and m["cpmoe_requests_running"] == 0
                    and used and not any(used))
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def processes(self) -> list[int]:
        """Pids of live processes this server started (itself and its ranks)."""
        return [pid for pid, state, _ in marked_processes(self.marker) if state != "Z"]

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Reference:
    """Tokens `cpmoe generate` gives for one prompt (one rank, in this process)."""

    def __init__(self, model_dir: Path, eos_ids: tuple[int, ...]) -> None:
        self.runner = ModelRunner(model_dir, ProcessGroups.single(), torch.float32,
                                  show_progress=False)
        self.eos_ids = eos_ids
        self._cache: dict[tuple, list[int]] = {}

    def tokens(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> list[int]:
        key = (tuple(prompt_ids), max_tokens, temperature, top_p, top_k, seed)
        if key not in self._cache:
            self.runner.kv = None  # generate sizes the cache for its own prompt
            self._cache[key] = generate(self.runner, [prompt_ids], max_tokens, self.eos_ids,
                                        SamplingParams(temperature, top_p, top_k, seed))[0]
        return self._cache[key]


    def batch(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, seed: int = 0
              ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """`cpmoe generate` of several prompts (prompt i on stream i) -> (tokens per prompt,
        the engine's logits [rows, V] of every step that sampled, in the engine's order)."""
        self.runner.kv = None
        seen: list[torch.Tensor] = []
        out = generate(self.runner, prompts, max_tokens, self.eos_ids,
                       SamplingParams(temperature, top_p, top_k, seed),
                       observe=lambda logits: seen.append(logits.clone()))
        return out, seen

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [V] after `ids`, from one whole prefill without a KV cache."""
        self.runner.kv = None
        return self.runner.prefill([ids], last_only=True)[0]


def marked_processes(marker: str) -> list[tuple[int, str, str]]:
    """(pid, state, cmdline) of every process whose environment carries the marker."""
    needle = f"CPMOE_E2E_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours
            continue
        if needle in env.split(b"\0"):
            found.append((int(entry), state, cmd.replace(b"\0", b" ").decode(errors="replace")))
    return found


FORKSERVER = "multiprocessing.forkserver"  # in the cmdline of a forkserver and its children


def pool_processes(marker: str) -> list[tuple[int, str, str]]:
    """The marked processes a RankPool started: its forkserver and ranks on cpu, its spawned
    ranks ('spawn_main') on cuda."""
    return [p for p in marked_processes(marker) if FORKSERVER in p[2] or "spawn_main" in p[2]]


def marked_ranks(marker: str) -> list[tuple[int, str, str]]:
    """The ranks among marked_processes(marker): spawned interpreters ('spawn_main'), or
    forks of a forkserver (RankPool on cpu): a forkserver cmdline whose parent process has
    one too (the forkserver itself is a child of the pool's owner)."""
    procs = pool_processes(marker)
    servers = {pid for pid, _, cmd in procs if FORKSERVER in cmd}
    return [p for p in procs if "spawn_main" in p[2] or _ppid(p[0]) in servers]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


# ---- module fixtures the serve tests share (import them into the test module) -------------

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpmoe-cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir, default_model_cache) -> Path:
    return default_model_cache(cache_dir)  # a copy of the session's build (tests/conftest.py)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    from cpmoe.models.registry import load_model_config
    cfg, _ = load_model_config(model_dir)
    return Reference(model_dir, cfg.eos_token_ids)


def ready_servers(servers: dict[str, "Server"]):
    """Wait until every server is ready, yield them, stop them all (a fixture's body)."""
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()
