"""Per-step summary of an engine profiler trace (POST /start_profile, bench-serving --profile).

    python3 -m bench.trace_steps PROFILE_DIR/cpmoe-...-rank0.trace.json.gz [--top 4]

For every "cpmoe step N <kind>" range of the trace: its host time, the GPU time of the
kernels and copies it launched (matched by the launch's correlation id) and their span on
the GPU, and the longest host calls inside it. A step whose host time far exceeds its GPU
time spent it on the host: a long call with no kernel behind it (a compile, a sync on a
pageable copy) shows in the last column.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

STEP = re.compile(r"cpmoe step (\d+) (\w+)")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return [e for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X"]


def steps(events: list[dict], top: int = 4) -> list[dict]:
    """-> one row per step range: number, kind, host_ms, gpu_ms, gpu_span_ms, kernels, and
    `longest` [(name, ms)] of the host calls inside it."""
    ranges = [e for e in events if e.get("cat") == "user_annotation" and STEP.match(e["name"])]
    device = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in DEVICE_CATS and "correlation" in e.get("args", {})}
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    rows = []
    for r in sorted(ranges, key=lambda e: e["ts"]):
        start, end = r["ts"], r["ts"] + r["dur"]
        inside = [e for e in host if e["tid"] == r["tid"] and start <= e["ts"] < end]
        launched = [device[e["args"]["correlation"]] for e in inside
                    if e.get("args", {}).get("correlation") in device]
        span = (max(k["ts"] + k["dur"] for k in launched) - min(k["ts"] for k in launched)
                if launched else 0.0)
        longest = sorted(inside, key=lambda e: -e["dur"])[:top]
        number, kind = STEP.match(r["name"]).groups()
        rows.append({"step": int(number), "kind": kind, "host_ms": r["dur"] / 1e3,
                     "gpu_ms": sum(k["dur"] for k in launched) / 1e3,
                     "gpu_span_ms": span / 1e3, "kernels": len(launched),
                     "longest": [(e["name"], e["dur"] / 1e3) for e in longest]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=4, help="longest host calls shown per step")
    args = ap.parse_args()
    rows = steps(load(args.trace), args.top)
    print("| step | kind | host ms | GPU ms | GPU span ms | kernels | longest host calls (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        calls = ", ".join(f"{n[:40]} {ms:.1f}" for n, ms in r["longest"])
        print(f"| {r['step']} | {r['kind']} | {r['host_ms']:.1f} | {r['gpu_ms']:.1f} | "
              f"{r['gpu_span_ms']:.1f} | {r['kernels']} | {calls} |")


if __name__ == "__main__":
    main()
