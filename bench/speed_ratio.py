"""Two `cpmoe bench` or two `cpmoe bench-one-batch` results of the same rows side by side: the
first's time over the second's for each row both hold (prefill seconds by length, decode ms a
step by batch; a file must hold one row of each: one layout, one input length); exit 1 where
a row named by --at is under --min, or missing.

    python3 -m bench.speed_ratio BF16.json FP8.json --min 1.6 --at 64 --names "bf16,FP8"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(path: Path) -> tuple[str, dict[int, float]]:
    """-> ("decode" | "prefill", {batch or length: ms a step or seconds})."""
    data = json.loads(path.read_text())
    found = data.get("rows") if isinstance(data, dict) else None
    if not found:
        sys.exit(f"{path}: expected a cpmoe bench or bench-one-batch JSON with 'rows', found "
                 f"none")
    if "decode_ms" in found[0]:
        kind, key, time = "decode", "batch", "decode_ms"
        found = [r for r in found if r.get("engine", "cpmoe") == "cpmoe"]
    else:
        kind, key, time = "prefill", "tokens", "seconds"
    times = {r[key]: r[time] for r in found}
    if len(times) != len(found):
        sys.exit(f"{path}: {len(found)} rows for {len(times)} {key} values; expected one row "
                 f"a {key} (one layout, one input length a file)")
    return kind, times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("base", type=Path)
    p.add_argument("other", type=Path)
    p.add_argument("--min", type=float, required=True, help="the ratio's target")
    p.add_argument("--at", default="", help="the batches or lengths held to --min, "
                   "comma-separated (default: every row both files hold)")
    p.add_argument("--names", default="base,other", help="the two runs' names, comma-separated")
    a = p.parse_args(argv)
    names = a.names.split(",")
    if len(names) != 2:
        sys.exit(f"--names {a.names!r}: expected two comma-separated names")
    (kind, base), (kind2, other) = rows(a.base), rows(a.other)
    if kind != kind2:
        sys.exit(f"{a.base} holds {kind} rows, {a.other} {kind2} rows: nothing to compare")
    try:
        held = [int(v) for v in a.at.split(",")] if a.at else sorted(base.keys() & other.keys())
    except ValueError:
        sys.exit(f"--at {a.at!r}: expected comma-separated integers")
    unit, key = ("ms a step", "batch") if kind == "decode" else ("s", "length")
    code = 0
    for k in sorted(base.keys() | other.keys() | set(held)):
        if k not in base or k not in other:
            print(f"{key} {k}: in {a.base.name if k in base else a.other.name} only")
            if k in held:
                code = 1
            continue
        ratio = base[k] / other[k]
        target = f", target >= {a.min}" if k in held else ""
        print(f"{kind} {key} {k}: {names[0]} {base[k]:.4g} {unit}, {names[1]} {other[k]:.4g} "
              f"{unit}: {ratio:.3f}x{target}")
        if k in held and ratio < a.min:
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
