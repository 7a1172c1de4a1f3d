"""`cpmoe plan --estimate`: its flags and the command (no GPU, no process, no weight read).

    cpmoe plan --estimate --gpus N --prompt-len L [--batch B] [--decode] [--json]
               [--shape NAME | --model DIR] [--calibration FILE]

With --gpus, every layout of N GPUs that `cpmoe plan` accepts (enumerate.py) is estimated
and ranked; without it, the one layout of the usual layout flags. The rates are the shipped
H200 defaults unless --calibration names a file from `cpmoe bench-calibrate`. Every bad
value is one line (InputError, exit 2) naming the flag.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cpmoe.bench.spec import SHAPES, BenchError, parse_config, read_shape
from cpmoe.cli.flags import InputError, layout_from_args, model_dir_from_args
from cpmoe.estimate import rates as rates_mod
from cpmoe.estimate.cost import EstimateError, ModelShape
from cpmoe.estimate.enumerate import ESTIMATED_BACKENDS, valid_layouts
from cpmoe.estimate.report import estimate, rank, text
from cpmoe.models.registry import check_model_fit, load_model_config


def add_estimate_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout estimate (with --estimate)")
    g.add_argument("--estimate", action="store_true",
                   help="predict memory, prefill (TTFT) and decode step time of layouts from "
                        "measured rates instead of printing one layout's groups")
    g.add_argument("--gpus", type=int, default=None,
                   help="rank every valid layout of this many GPUs (default: the layout flags')")
    g.add_argument("--prompt-len", type=int, default=None, help="tokens of each prompt")
    g.add_argument("--batch", type=int, default=1,
                   help="prompts prefilled together, and sequences of a decode step")
    g.add_argument("--decode", action="store_true",
                   help="rank by decode step time (at --prompt-len of context) instead of "
                        "prefill time")
    g.add_argument("--shape", choices=tuple(SHAPES), default=None,
                   help="a model shape of cpmoe bench instead of --model's config.json")
    g.add_argument("--calibration", type=Path, default=None,
                   help="rates from cpmoe bench-calibrate (default: the shipped H200 rates)")
    g.add_argument("--expert-imbalance", type=float, default=1.0,
                   help="busiest EP rank's expert slots over the mean (1: a balanced trained "
                        "router; random weights measured 1.22 at EP 2)")
    g.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="GPU memory weights + KV cache may take, as cpmoe serve's flag")


def stray_estimate_flag(args: argparse.Namespace) -> str | None:
    """One line when a flag of --estimate is given without it, else None."""
    given = [flag for flag, value in (("--gpus", args.gpus), ("--prompt-len", args.prompt_len),
                                      ("--decode", args.decode), ("--shape", args.shape),
                                      ("--calibration", args.calibration))
             if value not in (None, False)]
    if given and not args.estimate:
        return f"{', '.join(given)}: only with --estimate"
    return None


def run_estimate(args: argparse.Namespace) -> int:
    _check_flags(args)
    try:
        r = rates_mod.load(args.calibration) if args.calibration else rates_mod.H200
    except rates_mod.RatesError as e:
        raise InputError(str(e)) from None
    if args.shape is not None:
        if args.model is not None:
            raise InputError("--shape and --model: give one of them")
        try:
            name, raw = read_shape(args.shape, None)
        except BenchError as e:
            raise InputError(str(e)) from None
        cfg = parse_config(raw, f"--shape {name}")
    else:
        model_dir = model_dir_from_args(args)
        name, cfg = str(model_dir), load_model_config(model_dir)[0]
    try:
        shape = ModelShape.from_config(cfg)
    except EstimateError as e:
        raise InputError(str(e)) from None
    if args.gpus is None:
        layout = layout_from_args(args)
        check_model_fit(layout, cfg)  # LayoutError: one line, as plain `cpmoe plan`
        layouts = [layout]
    else:
        layouts = valid_layouts(args.gpus, cfg)
    ranked = rank([estimate(shape, lay, r, args.prompt_len, args.batch, args.expert_imbalance,
                            args.mem_fraction_static) for lay in layouts], args.decode)
    gpus = args.gpus or layouts[0].world_size
    header = (f"model {name}, {gpus} GPU{'s' if gpus > 1 else ''}, "
              f"{args.batch} x {args.prompt_len:,} tokens, rates: {r.device}; ranked by "
              f"{'decode step' if args.decode else 'prefill time'}")
    if args.prompt_len > cfg.max_position_embeddings:
        header += (f"\nnote: --prompt-len {args.prompt_len:,} is beyond the model's "
                   f"max_position_embeddings {cfg.max_position_embeddings:,}: an estimate "
                   f"of the shape, not a run the model would accept")
    if args.json:
        print(json.dumps({"model": name, "gpus": gpus,
                          "prompt_len": args.prompt_len, "batch": args.batch,
                          "ranked_by": "decode_step_s" if args.decode else "prefill_s",
                          "rates": r.device, "layouts": ranked}))
    else:
        print(text(ranked, header, args.decode))
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    if args.prompt_len is None or args.prompt_len < 1:
        raise InputError(f"--estimate needs --prompt-len >= 1, got {args.prompt_len}")
    if args.batch < 1:
        raise InputError(f"--batch must be >= 1, got {args.batch}")
    if args.gpus is not None:
        if args.gpus < 1:
            raise InputError(f"--gpus must be >= 1, got {args.gpus}")
        if args.tp_size not in (1, args.gpus):
            raise InputError(f"--gpus {args.gpus} ranks every layout of that many GPUs; "
                             f"drop --tp-size {args.tp_size} or give no --gpus")
    if not 1.0 <= args.expert_imbalance <= 64.0:
        raise InputError(f"--expert-imbalance must be in [1, 64], got {args.expert_imbalance}")
    if not 0.0 < args.mem_fraction_static < 1.0:
        raise InputError(f"--mem-fraction-static must be in (0, 1), got "
                         f"{args.mem_fraction_static}")
    if args.cp_strategy != "zigzag":
        raise InputError(f"--estimate models --cp-strategy zigzag only, got "
                         f"{args.cp_strategy} (interleave's CUDA fallback was never measured)")
    if args.gpus is None and args.moe_a2a_backend not in ESTIMATED_BACKENDS:
        raise InputError(f"--estimate models --moe-a2a-backend "
                         f"{', '.join(ESTIMATED_BACKENDS)}, got {args.moe_a2a_backend}")
    if args.quantization or args.kv_cache_dtype != "auto":
        raise InputError("--estimate models bf16 weights and K/V (its rates are bf16); drop "
                         "--quantization / --kv-cache-dtype")
