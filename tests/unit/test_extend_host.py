"""An extend step's CUDA path never waits on the GPU: no device value read on the host and
no copy from pageable host memory (a stream sync in PyTorch), whatever the layer count.
Counted on the CPU by bench/extend_host.py --cuda-paths, in a subprocess (it patches torch
process-wide)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _count(layers: int, *flags: str) -> tuple[int, int, str]:
    out = subprocess.run([sys.executable, "-m", "bench.extend_host", "--cuda-paths",
                          "--layers", str(layers), "--seqs", "3", "--new", "40",
                          "--prefix", "64", *flags], cwd=REPO_ROOT, capture_output=True,
                         text=True,
                         timeout=300, check=True).stdout
    m = re.search(r"(\d+) device ops/step .* (\d+) syncs/step", out)
    assert m, out
    return int(m.group(1)), int(m.group(2)), out


def test_an_extend_step_after_a_prefix_makes_no_host_sync():
    ops2, syncs2, out2 = _count(2)
    ops6, syncs6, out6 = _count(6)
    assert syncs2 == syncs6 == 0, (out2, out6)
    assert (ops6 - ops2) % 4 == 0 and ops6 > ops2, (out2, out6)  # the same ops per layer


def test_the_engine_step_picks_the_rows_to_sample_without_a_host_sync():
    """A chunk of a longer prompt rides with complete ones: run_step samples only the
    latter, and picking their logits rows must not wait on the GPU either (it did: a
    Python-list index is a copy from pageable memory)."""
    _, syncs, out = _count(2, "--engine-step")
    assert syncs == 0, out


def test_an_eager_decode_step_makes_no_host_sync():
    """A decode step outside the CUDA graphs (above --cuda-graph-max-bs, or with
    --disable-cuda-graph) uploads its ids, positions, slots, lengths and block table in one
    copy from pinned memory (it made two pageable copies: two stream syncs a step)."""
    _, syncs, out = _count(2, "--decode")
    assert syncs == 0, out
