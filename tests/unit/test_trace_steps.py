"""bench/trace_steps.py: per-step host and GPU time from a profiler trace, on a trace written
here by hand (two steps; the kernels' correlation ids tie them to their launches)."""

from __future__ import annotations

import gzip
import json

from bench.trace_steps import load, steps


def _ev(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": args}


def test_steps_add_up_the_kernels_each_step_launched(tmp_path):
    events = [
        _ev("user_annotation", "cpmoe step 3 prefill", 0, 10_000),
        _ev("cpu_op", "aten::mm", 100, 50),
        _ev("cuda_runtime", "cudaLaunchKernel", 120, 10, correlation=7),
        _ev("cuda_runtime", "cudaLaunchKernel", 200, 10, correlation=8),
        _ev("cpu_op", "slow host call", 300, 9_000),
        _ev("kernel", "gemm", 1_000, 2_000, tid=9, correlation=7),
        _ev("kernel", "norm", 3_500, 500, tid=9, correlation=8),
        _ev("user_annotation", "cpmoe step 4 decode", 20_000, 1_000),
        _ev("cuda_runtime", "cudaLaunchKernel", 20_100, 5, correlation=9),
        _ev("kernel", "attn", 20_200, 300, tid=9, correlation=9),
        # another thread's call inside step 4's time is not step 4's
        _ev("cpu_op", "other thread", 20_050, 800, tid=2),
        {"ph": "i", "name": "instant", "ts": 5, "pid": 1, "tid": 1},
    ]
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    rows = steps(load(path), top=2)
    assert [(r["step"], r["kind"]) for r in rows] == [(3, "prefill"), (4, "decode")]
    first, second = rows
    assert first["host_ms"] == 10.0 and first["gpu_ms"] == 2.5 and first["kernels"] == 2
    assert first["gpu_span_ms"] == 3.0  # from 1,000 to 4,000 us
    assert first["longest"] == [("slow host call", 9.0), ("aten::mm", 0.05)]
    assert second["gpu_ms"] == 0.3 and second["kernels"] == 1
    assert [n for n, _ in second["longest"]] == ["cudaLaunchKernel"]
