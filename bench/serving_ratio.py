"""Two bench-serving results of the same load side by side: output tok/s of the second over
the first, with output tokens, TPOT p50 and TTFT mean of both (TPOT "-" for one-token
outputs, whose ratio is the TTFT's), and each server's KV slots a rank where its metrics
were kept (a server that holds fewer requests at once makes a ratio of memory, not speed:
bf16 against FP8 weights on an 80 GB card); exit 1 under --min.

    python3 -m bench.serving_ratio BASE.json OTHER.json --min 0.8 --names "no grammar,JSON schema"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("base", type=Path)
    p.add_argument("other", type=Path)
    p.add_argument("--min", type=float, required=True, help="the ratio's target")
    p.add_argument("--names", default="base,other", help="the two runs' names, comma-separated")
    a = p.parse_args(argv)
    names = a.names.split(",")
    if len(names) != 2:
        sys.exit(f"--names {a.names!r}: expected two comma-separated names")
    runs = [json.loads(f.read_text()) for f in (a.base, a.other)]
    base, other = (r["summary"] for r in runs)
    ratio = other["output_token_throughput"] / base["output_token_throughput"]
    print(f"output tok/s: {names[0]} {base['output_token_throughput']:.0f}, {names[1]} "
          f"{other['output_token_throughput']:.0f} ({ratio:.2f}x, target >= {a.min}); output "
          f"tokens {base['total_output_tokens']} / {other['total_output_tokens']}; TPOT p50 "
          f"{_ms(base['tpot_s']['p50'])} / {_ms(other['tpot_s']['p50'])} ms; TTFT mean "
          f"{_ms(base['ttft_s']['mean'])} / {_ms(other['ttft_s']['mean'])} ms "
          f"({base['ttft_s']['mean'] / other['ttft_s']['mean']:.2f}x lower)")
    slots = [r.get("server_metrics", {}).get("cpmoe_kv_slots_capacity") for r in runs]
    if None not in slots:
        print(f"KV slots a rank: {slots[0]:.0f} / {slots[1]:.0f}")
    return 0 if ratio >= a.min else 1


def _ms(seconds: float | None) -> str:
    """A time in ms; "-" where the runs had none (TPOT of one-token outputs)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


if __name__ == "__main__":
    sys.exit(main())
