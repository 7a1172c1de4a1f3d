"""`cpmoe bench`: prefill throughput of random-weight models over layouts and lengths.

Every layout runs in its own freshly spawned world (a `RankPool`, one rank per GPU, also for
one rank on cuda, so device memory is given back when the pool closes); the HF baseline
runs in one more. Lengths run shortest first. When the first layout is tp=1, every other
layout and HF (which get the same random weights) are checked against its last-token logits
at every length: max |logit difference|, top-1 agreement, and the top-1/top-2 gaps that say
whether a top-1 flip is a finding or a near tie. A rank failure is recorded in its row and the run goes on: after an out-of-memory
the longer lengths of that layout are reported as not run, after any other failure a fresh
world takes the next length.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from cpmoe.bench import hf_task, model_task, report as rp
from cpmoe.bench.pooled import OOM, Pooled
from cpmoe.bench.spec import (
    SHAPES,
    BenchError,
    BenchLayout,
    active_params,
    model_flops,
    parse_config,
    parse_layouts,
    parse_lengths,
    read_shape,
)
from cpmoe.bench.timing import keep_multicast_off
from cpmoe.config import DTYPES, parse_dtype
from cpmoe.engine.sizing import fp8_attention_refusal
from cpmoe.models.registry import config_from_dict

COLLECTIVE_TIMEOUT_S = 300.0  # a 128K prefill's collectives wait at most for rank skew


def results_dir() -> Path:
    """Where a run without --out writes: `bench/` in cpmoe's cache folder ($CPMOE_CACHE_DIR,
    else ~/.cache/cpmoe), never the current directory."""
    root = os.environ.get("CPMOE_CACHE_DIR")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "cpmoe") / "bench"


def check_memory(raw: dict, layouts: list, dtype: torch.dtype, device: str, where: str) -> None:
    """Refuse, in one line, a run whose weights alone cannot fit: per GPU on CUDA, all ranks
    together in this machine's available memory on CPU (every rank is a local process)."""
    from cpmoe.engine.sizing import memory_per_rank
    cfg, model_cls = config_from_dict(raw, where)
    for bl in layouts:
        per_rank = [m["weight_bytes"] for m in memory_per_rank(cfg, model_cls, bl.layout,
                                                                 dtype)]
        if device == "cuda":
            have = min(torch.cuda.get_device_properties(i).total_memory
                       for i in range(bl.world_size))
            need, what = max(per_rank), "the largest rank's weights"
            place = f"a GPU has {have / 1e9:.1f} GB"
        else:
            have, need = _available_cpu_bytes(), sum(per_rank)
            what = f"the weights of its {bl.world_size} rank(s)"
            place = f"this machine has {have / 1e9:.1f} GB available"
        if have and need > have:
            raise BenchError(f"{where}, layout {bl.name} on {device}: {what} need "
                             f"{need / 1e9:.1f} GB, {place}; use a smaller --config or "
                             f"--shape tiny, more ranks, or --device cuda")


def _available_cpu_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0  # unknown: no check


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), default=None,
                     help="built-in model shape (default: qwen3-30b-a3b)")
    src.add_argument("--config", type=Path, default=None, help="an HF config.json")
    p.add_argument("--lengths", default="4096,16384", help="comma-separated prompt lengths")
    p.add_argument("--batch", type=int, default=1, help="prompts of each length per prefill")
    p.add_argument("--layouts", default="tp=1",
                   help="';'-separated layouts of key=value (tp, cp, dp, ep, backend, "
                        "strategy, placement=static|balanced), e.g. \"tp=1;tp=2,cp=2,ep=2\"")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers on one device (SDPA, grouped_mm experts)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="random weights and prompts")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default: <shape>-<UTC time>.json in $CPMOE_CACHE_DIR/bench, "
                        "else ~/.cache/cpmoe/bench)")
    p.add_argument("--plot", action="store_true", help="PNG of tokens/s vs length next to --out")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: quantize the random weights to 128x128-block FP8 at load")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="fp8_e4m3: prefill attention in FP8 as a server with FP8 K/V pools runs "
                        "it (CUDA, cuDNN)")


class _Run:
    """One `cpmoe bench` invocation: validated inputs, the rows so far, the JSON file."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        keep_multicast_off()
        self.shape, self.raw = read_shape(args.shape or (None if args.config else
                                                         "qwen3-30b-a3b"), args.config)
        self.cfg = parse_config(self.raw, str(args.config or f"--shape {self.shape}"))
        self.lengths = parse_lengths(args.lengths)
        self.layouts = parse_layouts(args.layouts, self.cfg)
        for flag in ("batch", "iters"):
            if getattr(args, flag) < 1:
                raise BenchError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
        if args.warmup < 0:
            raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
        self.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype_name = args.dtype or ("bfloat16" if self.device == "cuda" else "float32")
        self.dtype = parse_dtype(dtype_name)
        refusal = fp8_attention_refusal(args.kv_cache_dtype, torch.device(self.device),
                                        self.dtype)
        if refusal:
            raise BenchError(refusal)
        need = max(bl.world_size for bl in self.layouts)
        if self.device == "cuda" and torch.cuda.device_count() < need:
            raise BenchError(f"--layouts need {need} GPUs, {torch.cuda.device_count()} visible")
        if args.compare_hf and self.raw["architectures"][0] not in hf_task._MODEL_TYPES:
            raise BenchError(f"--compare-hf: no HF baseline for "
                             f"{self.raw['architectures'][0]}")
        check_memory(self.raw, self.layouts, self.dtype, self.device,
                     str(args.config or f"--shape {self.shape}"))
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        self.out = args.out or results_dir() / f"{self.shape}-{stamp}.json"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.head = rp.header(argv, self.shape, self.raw, active_params(self.cfg), dtype_name,
                              self.device, {"lengths": self.lengths, "batch": args.batch,
                                            "warmup": args.warmup, "iters": args.iters,
                                            "seed": args.seed,
                                            "layouts": [bl.name for bl in self.layouts],
                                            "compare_hf": args.compare_hf,
                                            "quantization": args.quantization,
                                            "kv_cache_dtype": args.kv_cache_dtype})
        self.rows: list[dict] = []
        first = self.layouts[0]
        self.tp1 = first.name if first.world_size == 1 else None
        self.ref_logits: dict[int, torch.Tensor] = {}  # length -> tp=1 last-token logits
        self.ref_note = ("no logit check: the first layout is not tp=1" if self.tp1 is None
                         else "no logit check: the tp=1 reference failed at this length")

    # ---- rows --------------------------------------------------------------------------
    def emit(self, row: dict) -> None:
        self.rows.append(row)
        rp.write_json(self.out, self.head, self.rows)

    def base(self, engine: str, layout: str, world: int, sizes: dict, length: int) -> dict:
        batch = self.args.batch
        quant = self.args.quantization if engine == "cpmoe" else None  # HF runs in bf16
        return {"engine": engine, "layout": layout, "world_size": world, "sizes": sizes,
                "length": length, "batch": batch, "tokens": batch * length,
                "quantization": quant}

    def check_logits(self, row: dict, logits: torch.Tensor | None, is_reference: bool) -> None:
        """Compare a row's last-token logits with the tp=1 layout's at the same length."""
        length = row["length"]
        if logits is not None:
            row["top1_top2_gap"] = top2_gap(logits.float())
        if is_reference:
            if logits is not None:
                self.ref_logits[length] = logits.float()
            row["check_note"] = "reference of the logit check"
            return
        ref = self.ref_logits.get(length)
        if logits is None or ref is None:
            row["check_note"] = self.ref_note
            return
        got = logits.float()
        row["logits_max_abs_diff_vs_tp1"] = float((got - ref).abs().max())
        row["top1_agrees_vs_tp1"] = bool(torch.equal(got.argmax(-1), ref.argmax(-1)))
        # Random weights give near-tied top logits: a flip is only a finding when the
        # reference's top-1/top-2 gap is larger than the logit difference.
        row["ref_top1_top2_gap"] = top2_gap(ref)

    # ---- engines -----------------------------------------------------------------------
    def run_layout(self, bl: BenchLayout) -> None:
        a = self.args
        spec = model_task.ModelSpec(self.raw, bl.layout, self.dtype, a.seed, a.batch, a.warmup,
                                    a.iters, bl.placement, a.quantization, a.kv_cache_dtype)
        is_ref = bl is self.layouts[0] and self.tp1 is not None
        sizes = bl.sizes()

        def on_setup(info: dict) -> None:
            self.head["gpu"] = self.head["gpu"] or info["device_name"]
            w = " / ".join(f"{b / rp.GIB:.2f}" for b in info["weight_bytes"])
            rp.progress(f"{bl.name}: model built in {info['build_s']:.1f} s, weights {w} GiB "
                        f"per rank")

        def on_result(length: int, res: dict, info: dict) -> dict:
            row = rp.measured_row(self.base("cpmoe", bl.name, bl.world_size, sizes, length),
                                  res, model_flops(self.cfg, [length] * a.batch),
                                  bl.world_size)
            row["weights_gib_per_rank"] = [b / rp.GIB for b in info["weight_bytes"]]
            if res["placement"]:
                b = row["expert_placement"] = res["placement"]
                rp.progress(f"{bl.name}: experts placed by a {b['calibration_tokens']}-token "
                            f"calibration prefill (another prompt); busiest EP rank's load / "
                            f"mean {b['busiest_rank_load_vs_mean_before']:.3f} -> "
                            f"{b['busiest_rank_load_vs_mean_after']:.3f}")
            self.check_logits(row, res.get("logits"), is_ref)
            return row

        _run_engine(bl.name, bl.world_size, self.device, model_task.setup_task,
                    model_task.length_task, spec, self.lengths,
                    keep_logits=self.tp1 is not None,
                    base=lambda n: self.base("cpmoe", bl.name, bl.world_size, sizes, n),
                    on_setup=on_setup, on_result=on_result, emit=self.emit)

    def run_hf(self) -> None:
        a = self.args
        spec = hf_task.HFSpec(self.raw, self.dtype, a.seed, a.batch, a.warmup, a.iters)
        sizes = {"world_size": 1}
        state: dict = {}

        def on_setup(info: dict) -> None:
            state.update(info)
            self.head["gpu"] = self.head["gpu"] or info["device_name"]
            self.head["hf"] = {k: v for k, v in info.items() if k != "device_name"}
            rp.progress(f"hf: model built in {info['build_s']:.1f} s (experts "
                        f"{info['experts_implementation']}, attention "
                        f"{info['attn_implementation']}, weights "
                        f"{'same as cpmoe' if info['same_weights'] else 'HF init'})")
            for note in info["notes"]:
                rp.progress(f"hf: WARNING {note}")

        def on_result(length: int, res: dict, info: dict) -> dict:
            row = rp.measured_row(self.base("hf", "hf", 1, sizes, length), res,
                                  model_flops(self.cfg, [length] * a.batch), 1)
            row["experts_implementation"] = info["experts_implementation"]
            if info["same_weights"]:
                self.check_logits(row, res.get("logits"), False)
            elif length == self.lengths[0]:
                row["check_note"] = "no logit check: HF has its own random weights"
            return row

        _run_engine("hf", 1, self.device, hf_task.setup_task, hf_task.length_task, spec,
                    self.lengths, keep_logits=True,
                    base=lambda n: self.base("hf", "hf", 1, sizes, n),
                    on_setup=on_setup, on_result=on_result, emit=self.emit)

    # ---- the whole run -----------------------------------------------------------------
    def finish(self) -> int:
        rp.relate_rows(self.rows, self.tp1)
        rp.write_json(self.out, self.head, self.rows)
        active, where = self.head["active_params"], f"{self.head['gpu'] or self.device}"
        arch = self.raw["architectures"][0]
        has_flops = any(r.get("model_flops") for r in self.rows)
        print(f"shape {self.shape}: active params {active:,} (embedding and lm_head excluded); "
              f"{where}, {self.head['dtype']}" if active else
              f"shape {self.shape}: MFU by the {arch} FLOPs model (cpmoe/bench/v4_flops.py); "
              f"{where}, {self.head['dtype']}" if has_flops else
              f"shape {self.shape}: no FLOPs model for {arch} (MFU -)")
        print(rp.markdown_table(self.rows))
        print(f"wrote {self.out}")
        if self.args.plot:
            png = self.out.with_suffix(".png")
            warning = rp.plot(self.rows, png, f"{self.shape} prefill, batch {self.args.batch}")
            print(f"cpmoe bench: warning: {warning}" if warning else f"wrote {png}",
                  file=sys.stderr if warning else sys.stdout)
        failed = [r for r in self.rows if r.get("error") and r["error"] != OOM]
        if failed:
            print(f"cpmoe bench: {len(failed)} row(s) failed (see 'error' in the JSON)",
                  file=sys.stderr)
        return 1 if failed else 0


def _run_engine(label: str, world: int, device: str, setup: Callable, measure: Callable,
                spec, lengths: list[int], *, keep_logits: bool, base: Callable[[int], dict],
                on_setup: Callable[[dict], None], on_result: Callable[[int, dict, dict], dict],
                emit: Callable[[dict], None]) -> None:
    """Set up once per world, then one task per length; a failure becomes a row. After an
    out-of-memory the longer lengths are not run; after another failure a new world is."""
    info: dict = {}
    oom_at: int | None = None
    with Pooled(world, device, COLLECTIVE_TIMEOUT_S) as pooled:
        for i, length in enumerate(lengths):
            if oom_at is not None:
                emit(rp.error_row(base(length), OOM,
                                  f"not run: length {oom_at} already ran out of memory"))
                continue
            if not pooled.started:
                rp.progress(f"{label}: starting {world} rank(s) on {device}, building the model")
                info, failed = pooled.run("building the model", setup, spec)
                if failed:
                    rp.progress(f"{label}: {failed.detail}")
                    for n in lengths[i:]:
                        emit(rp.error_row(base(n), failed.error, failed.detail))
                    return
                on_setup(info)
            rp.progress(f"{label}: length {length} x batch {spec.batch} "
                        f"({spec.warmup} warm-up, {spec.iters} timed)")
            res, failed = pooled.run(f"length {length}", measure, spec, length, keep_logits)
            if failed:
                rp.progress(f"{label}: {failed.detail}")
                emit(rp.error_row(base(length), failed.error, failed.detail))
                oom_at = length if failed.error == OOM else None
                continue
            row = on_result(length, res, info)
            emit(row)
            rp.progress(_row_line(row))


def top2_gap(logits_BV: torch.Tensor) -> float:
    """Smallest top-1 minus top-2 logit over the batch's rows."""
    top2 = logits_BV.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def _row_line(row: dict) -> str:
    mfu = (f", {rp.MFU_PEAK_LABEL} {100 * row['mfu']:.1f}% ({100 * row['mfu_vs_measured']:.1f}% "
           f"vs measured)" if row.get("mfu") is not None else
           f", {rp.MFU_FP8_LABEL} {100 * row['mfu_fp8']:.1f}%" if row.get("mfu_fp8") is not None
           else "")
    peak = (f", peak {'/'.join(f'{p:.1f}' for p in row['peak_gib_per_rank'])} GiB"
            if row.get("peak_gib_per_rank") else "")
    comm = (f", comm {'/'.join(f'{c:.3f}' for c in row['comm_s_per_rank'])} s"
            if row.get("comm_s_per_rank") else "")
    check = (f", max |dlogit| vs tp1 {row['logits_max_abs_diff_vs_tp1']:.2e} (top-1 "
             f"{'agrees' if row['top1_agrees_vs_tp1'] else 'differs'}, reference top-1/top-2 gap "
             f"{row['ref_top1_top2_gap']:.2e})"
             if "logits_max_abs_diff_vs_tp1" in row else "")
    return (f"{row['layout']}: length {row['length']} x {row['batch']}: {row['seconds']:.3f} s, "
            f"{row['tokens_per_s']:,.0f} tok/s{mfu}{peak}{comm}{check}")


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    """Validate everything (BenchError, LayoutError, ConfigError: one line), then run."""
    run = _Run(args, argv)
    for bl in run.layouts:
        run.run_layout(bl)
    if args.compare_hf:
        run.run_hf()
    return run.finish()
