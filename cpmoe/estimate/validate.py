"""Predicted prefill times against every recorded cpmoe prefill in bench/results.

    python3 -m cpmoe.estimate.validate [--results bench/results] [--calibration FILE]

prints one markdown row per recorded (file, layout, length): measured seconds, predicted
seconds and the error (predicted / measured - 1), then the files it left out and why (other
models, FP8 weights or FP8 attention, which the bf16 rates do not describe); then the decode
steps of DECODE_FILES (bf16 `bench-one-batch --routing uniform` runs on one GPU: the latest
one at batch 1 and 64, and the batch 16 / 256 and 32K-context runs), each at its mean
context, the prompt plus half the output. The records'
weights are random, and their router sends 79% of a layer's slots to 8 experts, so at EP 2
the busier rank computes 1.22x the mean slots (`python3 -m bench.expert_load`,
bench/results/profile-20261130.log); the prediction uses that imbalance for EP > 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cpmoe.bench.spec import parse_config, parse_layout
from cpmoe.estimate import cost, rates as rates_mod
from cpmoe.estimate.report import estimate

RANDOM_ROUTER_EP2_IMBALANCE = 1.22  # busiest EP rank / mean slots, profile-20261130.log
DECODE_FILES = ("verify-dec-bf16-d28a8e6.json", "one-batch-1k-edb9375.json",
                "one-batch-32k-edb9375.json")


def records(results: Path) -> tuple[list[dict], list[str]]:
    rows, skipped = [], []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue
        head = data.get("header", {})
        bench = [r for r in data["rows"] if isinstance(r, dict) and r.get("engine") == "cpmoe"
                 and "layout" in r and "length" in r and r.get("seconds")]
        if not bench or "config" not in head:
            continue
        why = _unmodelled(head)
        if why:
            skipped.append(f"{path.name}: {why}")
            continue
        for r in bench:
            rows.append({"file": path.name, "config": head["config"], "layout": r["layout"],
                         "length": r["length"], "batch": r.get("batch", 1),
                         "seconds": r["seconds"]})
    return rows, skipped


def _unmodelled(head: dict) -> str | None:
    arch = (head["config"].get("architectures") or ["?"])[0]
    if not arch.startswith("Qwen"):
        return f"{arch}, not a Qwen-MoE"
    if head.get("quantization"):
        return f"--quantization {head['quantization']} (the rates are bf16)"
    if head.get("kv_cache_dtype") not in (None, "auto"):
        return f"--kv-cache-dtype {head['kv_cache_dtype']} (FP8 attention)"
    if head.get("dtype", "bfloat16") != "bfloat16":
        return f"dtype {head['dtype']}"
    return None


def predict(row: dict, r: rates_mod.Rates) -> float:
    m = cost.ModelShape.from_config(parse_config(row["config"], row["file"]))
    layout = parse_layout(row["layout"]).layout
    imbalance = RANDOM_ROUTER_EP2_IMBALANCE if layout.ep_size > 1 else 1.0
    return estimate(m, layout, r, row["length"], row["batch"], imbalance)["prefill_s"]


def table(rows: list[dict], r: rates_mod.Rates) -> list[str]:
    out = ["| file | layout | length | measured s | predicted s | error |",
           "|---|---|---|---|---|---|"]
    for row in rows:
        p = predict(row, r)
        out.append(f"| {row['file']} | {row['layout']} | {row['length']:,} | "
                   f"{row['seconds']:.3f} | {p:.3f} | {p / row['seconds'] - 1:+.1%} |")
    return out


def decode_table(results: Path, r: rates_mod.Rates) -> list[str]:
    out = ["| file | batch | context | measured ms | predicted ms | error |",
           "|---|---|---|---|---|---|"]
    for name in DECODE_FILES:
        data = json.loads((results / name).read_text())
        head = data["header"]
        m = cost.ModelShape.from_config(parse_config(head["config"], name))
        for row in data["rows"]:
            if row.get("engine") != "cpmoe" or not row.get("decode_ms"):
                continue
            context = row["input_len"] + head["output_len"] // 2
            p = estimate(m, parse_layout("tp=1").layout, r, context,
                         row["batch"])["decode_step_s"] * 1e3
            out.append(f"| {name} | {row['batch']} | {context:,} | {row['decode_ms']:.2f} | "
                       f"{p:.2f} | {p / row['decode_ms'] - 1:+.1%} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m cpmoe.estimate.validate")
    ap.add_argument("--results", type=Path, default=Path("bench/results"))
    ap.add_argument("--calibration", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.results.is_dir():
        print(f"--results {args.results}: not a directory", file=sys.stderr)
        return 2
    try:
        r = rates_mod.load(args.calibration) if args.calibration else rates_mod.H200
    except rates_mod.RatesError as e:
        print(e, file=sys.stderr)
        return 2
    rows, skipped = records(args.results)
    print("\n".join(table(rows, r)))
    for s in skipped:
        print(f"left out: {s}")
    print()
    print("\n".join(decode_table(args.results, r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
