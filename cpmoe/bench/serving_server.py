"""The server side of `cpmoe bench-serving`: a `cpmoe serve` it starts itself (`--launch`),
and what it asks a running server (its model, /metrics, a profile)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from cpmoe.bench.spec import BenchError


class Launched:
    """`cpmoe serve` started by the benchmark (port chosen at run time), stopped at the end."""

    READY = re.compile(r"cpmoe: serving (\S+) at (http://\S+) ")

    def __init__(self, flags: list[str], timeout_s: float = 1800.0) -> None:
        cmd = [sys.executable, "-m", "cpmoe.cli", "serve", "--port", "0", *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout_s
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            m = self.READY.search(line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                break
            if time.monotonic() > deadline:
                break
        else:
            raise BenchError(f"--launch: the server exited ({self.proc.wait()}) before "
                             f"serving: {''.join(self.log[-5:]).strip()}")
        if not hasattr(self, "url"):
            self.stop()
            raise BenchError(f"--launch: the server was not ready in {timeout_s:.0f} s")
        import threading
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def launched_vocab(flags: list[str]) -> int:
    from cpmoe.config import read_config_json
    from cpmoe.default_model import ensure_default_model
    model = next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--model"), None)
    return int(read_config_json(Path(model) if model else ensure_default_model())["vocab_size"])


def chunk_size(flags: list[str]) -> int:
    from cpmoe.engine.options import DEFAULT_CHUNKED_PREFILL
    value = next((flags[i + 1] for i, f in enumerate(flags[:-1])
                  if f == "--chunked-prefill-size"), None)
    return int(value) if value is not None else DEFAULT_CHUNKED_PREFILL


def served_model(url: str) -> str:
    import httpx
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def post(url: str, path: str, body: dict | None) -> dict:
    import httpx
    r = httpx.post(f"{url}{path}", json=body, timeout=30)
    if r.status_code != 200:
        raise BenchError(f"--profile: {path} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def start_profile(url: str, num_steps: int | None) -> dict:
    """-> the server's answer (output_dir, name); says where the traces will be."""
    started = post(url, "/start_profile", {} if num_steps is None else
                    {"num_steps": num_steps})
    print(f"profiling the server's {num_steps or 'load'}{' steps' if num_steps else ''}: "
          f"traces {started['output_dir']}/{started['name']}-rank*.trace.json.gz")
    return started


def scrape(url: str, since: dict | None = None) -> dict:
    """The server's own counters (Prometheus text -> name: value). With `since` (an earlier
    scrape), counters and histograms count from it: the timed run's alone, not the warm-up's
    before it; gauges are as they are now."""
    import httpx
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except Exception:  # noqa: BLE001 -- a report without server counters
        return {}
    out, kinds = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            kinds[family] = kind
        elif line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    if since is not None:
        for name in out:
            if _kind(name, kinds) in ("counter", "histogram"):
                out[name] -= since.get(name, 0.0)
    return out


def _kind(sample: str, kinds: dict) -> str | None:
    family = sample.split("{", 1)[0]
    if family in kinds:
        return kinds[family]
    for suffix in ("_sum", "_count", "_bucket"):
        if family.endswith(suffix) and family[:-len(suffix)] in kinds:
            return kinds[family[:-len(suffix)]]
    return None


def server_mean(metrics: dict, name: str) -> float | None:
    """A histogram's mean from the server's counters (None: a server without it)."""
    n = metrics.get(f"{name}_count")
    return metrics[f"{name}_sum"] / n if n else None
