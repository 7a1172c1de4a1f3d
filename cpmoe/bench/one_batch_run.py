"""The command side of `cpmoe bench-one-batch`: flags, the worlds, the table, JSON and PNG
(the rank side is one_batch.py)."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from cpmoe.bench import one_batch as ob, report as rp
from cpmoe.bench.pooled import Pooled
from cpmoe.bench.spec import SHAPES, BenchError, parse_config, read_shape
from cpmoe.bench.timing import keep_multicast_off
from cpmoe.config import DTYPES, parse_dtype, read_config_json
from cpmoe.engine.sizing import fp8_attention_refusal, kv_cache_refusal
from cpmoe.models.registry import check_model_fit, model_class

COLLECTIVE_TIMEOUT_S = 600.0  # a world builds a 30B model and captures graphs first


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), default=None,
                     help="built-in model shape (default: qwen3-30b-a3b)")
    src.add_argument("--config", type=Path, default=None, help="an HF config.json")
    src.add_argument("--model", type=Path, default=None,
                     help="an HF checkpoint directory (with --load-format dummy: its shape)")
    p.add_argument("--batch-size", default="1,16,64,256", help="comma-separated batch sizes")
    p.add_argument("--input-len", default="1024", help="comma-separated prompt lengths")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--compare-hf", action="store_true",
                   help="also HF transformers on one device: eager (dynamic cache) and static "
                        "cache under torch.compile(mode='reduce-overhead')")
    p.add_argument("--hf-compile-batches", default=None,
                   help="batch sizes of the compiled HF rows (default: every batch size; "
                        "each compiles anew)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--seed", type=int, default=0, help="random weights and prompts")
    p.add_argument("--out", type=Path, required=True, help="JSON file of the results")
    p.add_argument("--plot", action="store_true", help="PNG of ms/step vs batch next to --out")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="write a torch.profiler table of one decode step per row (replayed "
                        "and eager, rank 0) into DIR")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise BenchError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise BenchError(f"{flag} {text!r}: every value must be >= 1")
    return values


def run_one_batch(args: argparse.Namespace, layout, engine, argv: list[str]) -> int:
    keep_multicast_off()
    if args.model is not None:
        raw, shape = read_config_json(args.model), args.model.name
    else:
        shape, raw = read_shape(args.shape or (None if args.config else "qwen3-30b-a3b"),
                                args.config)
    cfg = parse_config(raw, str(args.config or args.model or f"--shape {shape}"))
    check_model_fit(layout, cfg)
    refusal = kv_cache_refusal(engine.kv_cache_dtype, model_class(cfg.architecture))
    if refusal:
        raise BenchError(refusal)
    batches, lengths = _ints(args.batch_size, "--batch-size"), _ints(args.input_len,
                                                                     "--input-len")
    if args.output_len < 2:
        raise BenchError(f"--output-len must be >= 2 (one decode step), got {args.output_len}")
    compiled = (_ints(args.hf_compile_batches, "--hf-compile-batches")
                if args.hf_compile_batches else batches)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    refusal = fp8_attention_refusal(engine.kv_cache_dtype, torch.device(device),
                                    parse_dtype(dtype_name))
    if refusal:
        raise BenchError(refusal)
    if args.compare_hf and raw["architectures"][0] not in ("Qwen3MoeForCausalLM",
                                                            "Qwen2MoeForCausalLM"):
        raise BenchError(f"--compare-hf: no HF baseline for {raw['architectures'][0]}")
    if args.out.parent and not args.out.parent.is_dir():
        raise BenchError(f"--out {args.out}: folder {args.out.parent} does not exist")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    spec = ob.OneBatchSpec(raw, args.model if args.model else None, layout,
                           parse_dtype(dtype_name), args.seed, args.routing, max(batches),
                           max(lengths), args.output_len, engine, args.profile)
    head = rp.header(argv, shape, raw, None, dtype_name, device,
                     {"batch_sizes": batches, "input_lens": lengths,
                      "output_len": args.output_len, "routing": args.routing,
                      "layout": layout.summary(), "engine": engine.__dict__})
    head["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        args.out.write_text(json.dumps({"header": head, "rows": rows}, indent=1,
                                       default=str) + "\n")
        rp.progress(_line(row))

    routers = _run_cpmoe(spec, layout.world_size, device, batches, lengths, head, emit)
    if args.compare_hf:
        _run_hf(spec, device, batches, lengths, compiled, routers, head, emit)
    _relate(rows)
    args.out.write_text(json.dumps({"header": head, "rows": rows}, indent=1, default=str)
                        + "\n")
    print(markdown(rows))
    print(f"wrote {args.out}")
    if args.plot:
        warning = plot(rows, args.out.with_suffix(".png"), f"{shape} decode, {dtype_name}")
        print(f"cpmoe bench-one-batch: warning: {warning}" if warning else
              f"wrote {args.out.with_suffix('.png')}")
    return 1 if any(r.get("error") for r in rows) else 0


def _run_cpmoe(spec, world: int, device: str, batches, lengths, head, emit) -> dict | None:
    with Pooled(world, device, COLLECTIVE_TIMEOUT_S) as pooled:
        rp.progress(f"cpmoe: starting {world} rank(s), building the model, capturing graphs")
        info, failed = pooled.run("building the model", ob.setup_task, spec)
        if failed:
            emit({"engine": "cpmoe", "error": failed.error, "detail": failed.detail})
            return None
        head["gpu"] = info["device_name"]
        head["cpmoe"] = {k: v for k, v in info.items() if k != "routers"}
        rp.progress(f"cpmoe: built in {info['build_s']:.1f} s, KV {info['kv_capacity']} tokens "
                    f"per rank, CUDA graphs {info['graph_bytes'] / 2**20:.0f} MiB")
        for length in lengths:
            for batch in batches:
                res, failed = pooled.run(f"batch {batch} x {length}", ob.row_task, spec, batch,
                                         length)
                base = {"engine": "cpmoe", "batch": batch, "input_len": length}
                emit({**base, "error": failed.error, "detail": failed.detail} if failed
                     else {**base, **res})
                if failed:
                    return info["routers"]
        return info["routers"]


def _run_hf(spec, device: str, batches, lengths, compiled, routers, head, emit) -> None:
    with Pooled(1, device, COLLECTIVE_TIMEOUT_S) as pooled:
        rp.progress("hf: building the model with cpmoe's weights")
        info, failed = pooled.run("building the HF model", ob.hf_setup_task, spec, routers)
        if failed:
            emit({"engine": "hf", "error": failed.error, "detail": failed.detail})
            return
        head["hf"] = info
        for length in lengths:
            for batch in batches:
                for mode in ("eager", "static+compile"):
                    if mode != "eager" and batch not in compiled:
                        continue
                    res, failed = pooled.run(f"hf {mode} batch {batch} x {length}",
                                             ob.hf_row_task, spec, batch, length,
                                             mode != "eager")
                    base = {"engine": f"hf {mode}", "batch": batch, "input_len": length}
                    emit({**base, "error": failed.error, "detail": failed.detail} if failed
                         else {**base, **res})


def _relate(rows: list[dict]) -> None:
    """Each cpmoe row: its speed-up over each HF row of the same shape, and greedy tokens
    compared with HF eager (bf16 runs of two engines flip near-tied tokens: a fraction)."""
    ours = {(r["batch"], r["input_len"]): r for r in rows
            if r.get("engine") == "cpmoe" and "decode_ms" in r}
    for r in rows:
        mine = ours.get((r.get("batch"), r.get("input_len")))
        if mine is None or r is mine or "decode_ms" not in r:
            continue
        mine[f"speedup_vs_{r['engine']}"] = r["decode_ms"] / mine["decode_ms"]
        if r["engine"] == "hf eager":
            pairs = [(a, b) for x, y in zip(mine["tokens"], r["tokens"]) for a, b in zip(x, y)]
            first = [x[0] == y[0] for x, y in zip(mine["tokens"], r["tokens"])]
            mine["first_token_matches_hf"] = sum(first) / len(first)
            mine["tokens_match_hf"] = sum(a == b for a, b in pairs) / max(1, len(pairs))


def markdown(rows: list[dict]) -> str:
    cols = ["engine", "batch", "input", "prefill s", "decode ms/step", "tok/s",
            "roofline ms", "x roofline", "experts/layer", "busiest/mean", "peak GiB",
            "vs HF eager", "vs HF compiled", "error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        dist = r.get("distinct_experts_per_layer")
        peak = r.get("peak_bytes_per_rank")
        lines.append("| " + " | ".join([
            r.get("engine", ""), str(r.get("batch", "")), str(r.get("input_len", "")),
            rp._fmt(r.get("prefill_s"), ".3f"), rp._fmt(r.get("decode_ms"), ".2f"),
            rp._fmt(r.get("decode_tok_s"), ",.0f"), rp._fmt(r.get("roofline_ms"), ".2f"),
            rp._fmt(r.get("vs_roofline"), ".2f"),
            rp._fmt(sum(dist) / len(dist) if dist else None, ".1f"),
            rp._fmt(max(r["busiest_expert_vs_mean"]) if r.get("busiest_expert_vs_mean")
                    else None, ".2f"),
            rp._fmt(max(peak) / 2**30 if peak and max(peak) > 0 else None, ".1f"),
            rp._fmt(r.get("speedup_vs_hf eager"), ".2f"),
            rp._fmt(r.get("speedup_vs_hf static+compile"), ".2f"),
            r.get("error") or ""]) + " |")
    return "\n".join(lines)


def _line(r: dict) -> str:
    if r.get("error"):
        return f"{r.get('engine')}: {r.get('error')}: {r.get('detail')}"
    roof = (f", roofline {r['roofline_ms']:.2f} ms ({r['vs_roofline']:.2f}x)"
            if "roofline_ms" in r else "")
    return (f"{r['engine']}: batch {r['batch']} x {r['input_len']}: prefill "
            f"{r['prefill_s']:.3f} s, decode {r['decode_ms']:.2f} ms/step "
            f"({r['decode_tok_s']:,.0f} tok/s){roof}")


def plot(rows: list[dict], path: Path, title: str) -> str | None:
    plt = rp.pyplot()
    if plt is None:
        return rp.NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        if "decode_ms" in r:
            series.setdefault((r["engine"], r["input_len"]), []).append((r["batch"],
                                                                         r["decode_ms"]))
            if "roofline_ms" in r:
                series.setdefault(("HBM roofline", r["input_len"]), []).append(
                    (r["batch"], r["roofline_ms"]))
    for (engine, length), points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=f"{engine} (input {length})",
                linestyle=":" if engine == "HBM roofline" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode ms / step")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
