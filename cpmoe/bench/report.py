"""Rows, the JSON file, the markdown table and the plot of `cpmoe bench`.

A row is one (engine, layout, length) measurement or its error; the JSON file is
{"header": {...}, "rows": [...]} and is rewritten after every row, so a run that dies keeps
what it measured. Cross-row figures (speed-up vs the one-rank layout, ratio vs HF) are
filled in by `relate_rows` once a run is complete.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cpmoe.bench.provenance import provenance  # noqa: F401 (rp.provenance)
from cpmoe.bench.spec import (H200_BF16_MEASURED_FLOPS, H200_BF16_PEAK_FLOPS,
                              H200_FP8_PEAK_FLOPS, MFU_FORMULA, mfu)

GIB = 2**30


MFU_PEAK_LABEL = f"MFU vs {H200_BF16_PEAK_FLOPS / 1e12:.0f} TF/s peak"
MFU_MEASURED_LABEL = f"MFU vs {H200_BF16_MEASURED_FLOPS / 1e12:.0f} TF/s measured"
MFU_FP8_LABEL = f"MFU vs {H200_FP8_PEAK_FLOPS / 1e12:.0f} TF/s FP8 peak"


def header(argv: list[str], shape: str, raw_config: dict, active: int | None, dtype: str,
           device: str, args: dict) -> dict:
    """The header of a model benchmark's JSON: provenance (code, machine, versions, command)
    + what was run. "gpu" is filled in from the first rank 0 that reports its device."""
    return {
        **provenance(argv), "gpu": None,
        "shape": shape, "config": raw_config, "active_params": active,
        "active_params_note": "decoder layers + final norm; embedding and lm_head excluded",
        "peak_flops_per_gpu": H200_BF16_PEAK_FLOPS,
        "peak_flops_per_gpu_note": "H200 SXM dense bf16 datasheet peak (the MFU denominator)",
        "measured_flops_per_gpu": H200_BF16_MEASURED_FLOPS,
        "measured_flops_per_gpu_note": "measured dense bf16 matmul ceiling (mfu_vs_measured)",
        "fp8_peak_flops_per_gpu": H200_FP8_PEAK_FLOPS,
        "fp8_peak_flops_per_gpu_note": "H200 SXM dense FP8 datasheet peak (mfu_fp8: rows of "
                                       "--quantization fp8)",
        "mfu_formula": MFU_FORMULA,
        "dtype": dtype, "device": device, **args,
    }


def measured_row(base: dict, res: dict, flops: float | None, world: int) -> dict:
    """base (engine, layout, length, ..., quantization for cpmoe's rows) + a task's result
    -> a full row; its MFU against the peak of the precision its GEMMs run in (`_mfus`)."""
    seconds = max(res["seconds_per_rank"])  # the slowest rank finishes the batch
    peaks = res["peak_bytes_per_rank"]
    row = dict(base)
    row.update({
        "seconds": seconds, "seconds_per_rank": res["seconds_per_rank"],
        "seconds_iters_rank0": res["seconds_iters_rank0"],
        "tokens_per_s": base["tokens"] / seconds if seconds > 0 else None,
        "model_flops": flops,
        "model_tflops_per_s": flops / seconds / 1e12 if flops and seconds > 0 else None,
        **_mfus(flops, seconds, world, base.get("quantization")),
        "peak_gib_per_rank": None if min(peaks) < 0 else [p / GIB for p in peaks],
        "comm_s_per_rank": res.get("comm_s_per_rank"),
        "comm_s_by_group_per_rank": res.get("comm_s_by_group_per_rank"),
        "error": None,
    })
    return row


def error_row(base: dict, error: str, detail: str | None = None) -> dict:
    row = dict(base)
    row.update({"seconds": None, "tokens_per_s": None, "mfu": None, "mfu_vs_measured": None,
                "peak_gib_per_rank": None,
                "comm_s_per_rank": None, "error": error})
    if detail:
        row["error_detail"] = detail
    return row


def relate_rows(rows: list[dict], tp1_layout: str | None) -> None:
    """speedup_vs_tp1 for every cpmoe row, ratio_vs_hf for one-rank cpmoe rows."""
    def tok_s(engine: str, layout: str | None, length: int, batch: int) -> float | None:
        for r in rows:
            if (r["engine"], r["layout"], r["length"], r["batch"]) == (engine, layout, length,
                                                                        batch):
                return r.get("tokens_per_s")
        return None

    for r in rows:
        if r["engine"] != "cpmoe" or not r.get("tokens_per_s"):
            continue
        ref = tok_s("cpmoe", tp1_layout, r["length"], r["batch"]) if tp1_layout else None
        r["speedup_vs_tp1"] = r["tokens_per_s"] / ref if ref else None
        hf = tok_s("hf", "hf", r["length"], r["batch"])
        r["ratio_vs_hf"] = r["tokens_per_s"] / hf if hf and r["world_size"] == 1 else None


def write_json(path: Path, head: dict, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"header": head, "rows": rows}, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _per_rank(values: list[float] | None, spec: str) -> str:
    return "-" if not values else "/".join(format(v, spec) for v in values)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown_table(rows: list[dict]) -> str:
    fp8 = any("mfu_fp8" in r for r in rows)  # its column only where a row has it
    cols = ["layout", "length", "batch", "s", "tok/s", MFU_PEAK_LABEL, MFU_MEASURED_LABEL,
            *([MFU_FP8_LABEL] if fp8 else []),
            "peak GiB/rank", "comm s/rank", "vs HF", "vs tp1", "max |dlogit| vs tp1",
            "top-1 = tp1", "top-1/top-2 gap tp1 / this", "error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["layout"], str(r["length"]), str(r["batch"]), _fmt(r.get("seconds"), ".3f"),
                 _fmt(r.get("tokens_per_s"), ",.0f"), _pct(r.get("mfu")),
                 _pct(r.get("mfu_vs_measured")), *([_pct(r.get("mfu_fp8"))] if fp8 else []),
                 _per_rank(r.get("peak_gib_per_rank"), ".1f"),
                 _per_rank(r.get("comm_s_per_rank"), ".3f"),
                 _fmt(r.get("ratio_vs_hf"), ".2f"), _fmt(r.get("speedup_vs_tp1"), ".2f"),
                 _fmt(r.get("logits_max_abs_diff_vs_tp1"), ".2e"),
                 _top1(r), _fmt(r.get("ref_top1_top2_gap"), ".2e") + " / " +
                 _fmt(r.get("top1_top2_gap"), ".2e"), r.get("error") or ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _top1(r: dict) -> str:
    if r.get("top1_agrees_vs_tp1") is None:
        return "-"
    if r["top1_agrees_vs_tp1"]:
        return "yes"
    # Each logit moved by at most the max difference, so a flip with the reference's gap
    # within twice that is a near tie of random weights, not a finding.
    tie = r["ref_top1_top2_gap"] <= 2 * r["logits_max_abs_diff_vs_tp1"]
    return "no (near tie)" if tie else "**no**"


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def pyplot():
    """matplotlib.pyplot on the file-only backend, or None where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


NO_MATPLOTLIB = "matplotlib is not installed: no plot"


def plot(rows: list[dict], path: Path, title: str) -> str | None:
    """tokens/s vs length, one line per layout, HF dashed; -> a warning, or None if drawn."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("tokens_per_s"):
            series.setdefault((r["layout"], r["batch"]), []).append((r["length"],
                                                                     r["tokens_per_s"]))
    batches = {b for _, b in series}
    for (layout, batch), points in series.items():
        points.sort()
        label = layout if len(batches) == 1 else f"{layout} (batch {batch})"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label,
                linestyle="--" if layout == "hf" else "-")
    ax.set_xscale("log", base=2)
    lengths = sorted({r["length"] for r in rows})
    ax.set_xticks(lengths, [_length_label(n) for n in lengths])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill tokens/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _mfus(flops: float | None, seconds: float, world: int, quantization: str | None) -> dict:
    """MFU against the datasheet peak of the precision the GEMMs run in: bf16's (and against
    the measured bf16 ceiling), or for --quantization fp8 FP8's alone (a bf16 denominator
    put FP8 runs over 100% of the measured ceiling)."""
    if quantization == "fp8":
        return {"mfu": None, "mfu_vs_measured": None,
                "mfu_fp8": mfu(flops, seconds, world, H200_FP8_PEAK_FLOPS)}
    return {"mfu": mfu(flops, seconds, world),
            "mfu_vs_measured": mfu(flops, seconds, world, H200_BF16_MEASURED_FLOPS)}


def recompute_mfu(rows: list[dict], quantization: str | None = None) -> None:
    """The MFU columns from each row's model_flops, seconds and world_size (`_mfus`; the
    file's --quantization, from its header, for cpmoe's rows): files written before the
    datasheet denominator hold MFU against the measured ceiling in "mfu"."""
    for r in rows:
        if r.get("model_flops") and r.get("seconds"):
            quant = r.get("quantization", quantization if r.get("engine") == "cpmoe" else None)
            r.update(_mfus(r["model_flops"], r["seconds"], r["world_size"], quant))


def main(argv: list[str] | None = None) -> int:
    """python3 -m cpmoe.bench.report FILE...: the markdown table of `cpmoe bench` result
    files, MFU recomputed against the datasheet peak and the measured ceiling."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python3 -m cpmoe.bench.report RESULT.json...", file=sys.stderr)
        return 2
    for path in paths:
        result = json.loads(Path(path).read_text())
        rows = result["rows"]
        recompute_mfu(rows, result.get("header", {}).get("quantization"))
        print(f"{path}:\n{markdown_table(rows)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
