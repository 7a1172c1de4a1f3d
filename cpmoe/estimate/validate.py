"""Predicted prefill times against every recorded cpmoe prefill in bench/results.

    python3 -m cpmoe.estimate.validate [--results bench/results] [--calibration FILE]

prints one markdown row per recorded (file, layout, length): measured seconds, predicted
seconds and the error (predicted / measured - 1), then the files it left out and why (other
models, FP8 weights or FP8 attention, which the bf16 rates do not describe); then every
multi-GPU row as a speed-up over its own file's one-GPU row; then CP attention alone
(ATTENTION_FILES) and dispatch + combine against NCCL all_to_all (DISPATCH_FILE) on 2 GPUs;
then the decode
steps of DECODE_FILES (bf16 `bench-one-batch --routing uniform` runs on one GPU: the latest
one at batch 1 and 64, and the batch 16 / 256 and 32K-context runs), each at its mean
context, the prompt plus half the output; last, the two-GPU file's peak memory per rank
against the estimate's weights + prefill transients. The records'
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
ATTENTION_FILES = ("attention_cp-20261130.json", "attention_cp-merge-20261130.json")
DISPATCH_FILE = "dispatch-device-time-20261130.json"
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
                         "seconds": r["seconds"],
                         "peak_gib": max(r.get("peak_gib_per_rank") or [0.0])})
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


def memory_table(rows: list[dict], r: rates_mod.Rates) -> list[str]:
    """Peak GiB of the busiest rank (weights + the prefill's transients) against the
    estimate's weights + transients, for the rows that recorded a peak."""
    out = ["| file | layout | length | measured peak GiB | predicted | error |",
           "|---|---|---|---|---|---|"]
    for row in rows:
        if not row["peak_gib"] or "2gpu-2" not in row["file"]:
            continue
        m = cost.ModelShape.from_config(parse_config(row["config"], row["file"]))
        layout = parse_layout(row["layout"]).layout
        imbalance = RANDOM_ROUTER_EP2_IMBALANCE if layout.ep_size > 1 else 1.0
        e = estimate(m, layout, r, row["length"], row["batch"], imbalance)
        p = e["weights_gib_per_rank"] + e["prefill_transient_gib_per_rank"]
        out.append(f"| {row['file']} | {row['layout']} | {row['length']:,} | "
                   f"{row['peak_gib']:.1f} | {p:.1f} | {p / row['peak_gib'] - 1:+.1%} |")
    return out


def speedup_table(rows: list[dict], r: rates_mod.Rates) -> list[str]:
    """Multi-GPU rows as speed-ups over the same file's one-GPU row at that length: the
    measured ratio (both sides from one run) against the predicted one."""
    out = ["| file | layout | length | measured speed-up | predicted | error |",
           "|---|---|---|---|---|---|"]
    base = {(row["file"], row["length"]): row for row in rows if row["layout"] == "tp=1"}
    for row in rows:
        one = base.get((row["file"], row["length"]))
        if row["layout"] == "tp=1" or one is None:
            continue
        measured = one["seconds"] / row["seconds"]
        predicted = predict(one, r) / predict(row, r)
        out.append(f"| {row['file']} | {row['layout']} | {row['length']:,} | "
                   f"{measured:.2f}x | {predicted:.2f}x | {predicted / measured - 1:+.1%} |")
    return out


def attention_table(results: Path, r: rates_mod.Rates) -> list[str]:
    """`cpmoe.bench.attention_cp`'s cpmoe rows (zigzag CP attention alone, its K/V gather
    included) against the attention and K/V exchange terms of one layer."""
    out = ["| file | ranks | length | measured ms | predicted ms | error |",
           "|---|---|---|---|---|---|"]
    for name in ATTENTION_FILES:
        data = json.loads((results / name).read_text())
        h = data["header"]
        m = cost.ModelShape(1, h["q_heads"] * h["head_dim"], h["q_heads"], h["kv_heads"],
                            h["head_dim"], 1, 1, 1, 0, 0, 0, 1, False)
        for row in data["rows"]:
            if row["engine"] != "cpmoe_cp" or not row.get("seconds"):
                continue
            lay = parse_layout(f"tp={row['ranks']},cp={row['ranks']}").layout
            t = cost.prefill_layer(m, lay, r, row["length"])
            p = (t["attention"] + t["kv_exchange"]) * 1e3
            out.append(f"| {name} | {row['ranks']} | {row['length']:,} | "
                       f"{row['seconds'] * 1e3:.1f} | {p:.1f} | "
                       f"{p / (row['seconds'] * 1e3) - 1:+.1%} |")
    return out


def dispatch_table(results: Path, r: rates_mod.Rates) -> list[str]:
    """`cpmoe.bench.dispatch` device times: alltoall_padded's dispatch + combine and NCCL
    all_to_all's bus bandwidth, each against the all-to-all term at the row's bytes."""
    data = json.loads((results / DISPATCH_FILE).read_text())
    out = ["| tokens/rank | remote MiB/rank | padded dispatch + combine ms, measured | "
           "predicted | error | NCCL a2a GB/s, measured | predicted | error |",
           "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        if row.get("error") or row["backend"] != "alltoall_padded":
            continue
        n, remote = row["ranks"], max(row["remote_bytes_per_rank"])
        measured = max(a + b for a, b in zip(row["dispatch_device_s_per_rank"],
                                             row["combine_device_s_per_rank"])) * 1e3
        p = 2 * cost.all_to_all_s(r.all_to_all, n, remote, r.padded_a2a_efficiency) * 1e3
        nccl = row["nccl_device_busbw_gbps"]
        p_bw = remote / cost.all_to_all_s(r.all_to_all, n, remote) / 1e9
        out.append(f"| {row['tokens_per_rank']:,} | {remote / 2**20:.1f} | {measured:.3f} | "
                   f"{p:.3f} | {p / measured - 1:+.1%} | {nccl:.0f} | {p_bw:.0f} | "
                   f"{p_bw / nccl - 1:+.1%} |")
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
    print("\n".join(speedup_table(rows, r)))
    for part in (attention_table, dispatch_table, decode_table):
        print()
        print("\n".join(part(args.results, r)))
    print()
    print("\n".join(memory_table(rows, r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
