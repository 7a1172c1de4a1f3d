"""`cpmoe bench` and `cpmoe bench-one-batch` take `--quantization fp8` (random weights
quantized to 128x128 FP8 blocks at load; on CPU the model runs on the FP8-rounded weights).

The two runs are subprocesses started together (module fixture `runs`): run one after the
other, each an interpreter and a torch import, they left one of CI's 2 cores idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cpmoe.cli", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ),
                          check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (future of the finished run, its --out file)."""
    d = tmp_path_factory.mktemp("fp8-bench")
    calls = {
        "bench": (["bench", "--shape", "tiny", "--device", "cpu", "--iters", "1", "--warmup",
                   "0", "--lengths", "64", "--layouts", "tp=1", "--quantization", "fp8",
                   "--out", str(d / "fp8.json")], d / "fp8.json"),
        "bench-one-batch": (["bench-one-batch", "--shape", "tiny", "--device", "cpu",
                             "--batch-size", "2", "--input-len", "16", "--output-len", "3",
                             "--quantization", "fp8", "--out", str(d / "one.json")],
                            d / "one.json"),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: (pool.submit(_run, args), out) for name, (args, out) in calls.items()}


def test_bench_takes_quantization_fp8(runs):
    future, out = runs["bench"]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"quantization": "fp8"' in out.read_text()  # in the run's header
    data = json.loads(out.read_text())
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in data["rows"])


def test_bench_one_batch_takes_quantization_fp8(runs):
    future, out = runs["bench-one-batch"]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp8" in out.read_text()
