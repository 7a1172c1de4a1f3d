"""bench-serving stopped by SIGTERM (a time limit's `timeout`) while its --launch server is
up: the server it started is stopped too, not left holding the machine (on the H200 such a
leftover server held 123 GiB and the next part of the call ran out of memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from tests.e2e._serve_helpers import REPO_ROOT


def _alive(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False)
    return out.stdout.split()


def test_sigterm_to_bench_serving_stops_the_server_it_launched(tmp_path):
    marker = f"stop-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpmoe.cli", "bench-serving", "--num-prompts", "64",
         "--random-input-len", "16", "--random-output-len", "4000", "--max-concurrency", "2",
         "--warmup-requests", "0", "--out", str(tmp_path / "b.json"), "--launch",
         "--device", "cpu", "--served-model-name", marker],
        cwd=str(REPO_ROOT), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the load has started once the progress bar shows
            if "requests:" in line:
                break
        assert _alive(marker), "the launched server is not running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) != 0
        deadline = time.monotonic() + 60
        while _alive(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(marker), "the launched server outlived bench-serving"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _alive(marker):
            os.kill(int(pid), signal.SIGKILL)
