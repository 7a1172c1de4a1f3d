"""The `cpmoe` parser (every subcommand, its flags, defaults shown in --help) and `main`, which
turns every failure into its exit code and one line."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

from cpmoe.cli.bench import (cmd_bench, cmd_bench_calibrate, cmd_bench_one_batch,
                             cmd_bench_serving)
from cpmoe.cli.flags import (USER_ERRORS, TORCHRUN_QUIET_EXIT_S, add_context_flag,
                             add_engine_flags, add_kv_cache_dtype_flag, add_layout_flags,
                             add_model_flags, add_quantization_flag)
from cpmoe.cli.plan import cmd_plan
from cpmoe.cli.run import cmd_check, cmd_generate, cmd_prefill
from cpmoe.cli.serve import cmd_serve
from cpmoe.parallel.failures import RankFailure, peer_loss
from cpmoe.parallel.launch import torchrun_rank
from cpmoe.serve.options import add_serve_arguments

DESCRIPTION = "`cpmoe` command line: plan / prefill / generate / check / bench / serve."


class _Help(argparse.HelpFormatter):
    """--help lists every flag's default (flags whose help already names it excepted)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return (bool(action.option_strings) and action.default is not None
                and action.default is not False and action.default != argparse.SUPPRESS
                and "default" not in (action.help or ""))

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):  # argparse skips empty help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not self._shows_default(action) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpmoe", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print sizes, groups and per-layer token layouts")
    add_layout_flags(p)
    add_model_flags(p)
    add_quantization_flag(p)
    add_kv_cache_dtype_flag(p)
    p.add_argument("--json", action="store_true")
    from cpmoe.estimate.command import add_estimate_flags
    add_estimate_flags(p)
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("prefill", help="prefill a batch and dump all-position logits")
    add_layout_flags(p)
    add_model_flags(p)
    p.add_argument("--input-ids-file", type=Path, required=True)
    p.add_argument("--dump-logits", type=Path, required=True)
    add_context_flag(p)
    p.set_defaults(fn=cmd_prefill)
    p = sub.add_parser("generate", help="generate tokens: greedy by default, sampled with "
                       "--temperature > 0", formatter_class=_Help)
    add_layout_flags(p)
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--input-ids")
    src.add_argument("--prompts-file", type=Path, help="JSON list of strings or id lists")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    add_context_flag(p)
    add_engine_flags(p, "what the prompts need at once on CPU; --mem-fraction-static on CUDA")
    p.add_argument("--json", action="store_true", help="print tokens and text as JSON")
    p.add_argument("--verbose", action="store_true", help="per-rank memory and timings")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("check", help="compare a layout against the one-rank reference")
    add_layout_flags(p)
    add_model_flags(p)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--lengths", default="17,64,129")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--decode-steps", type=int, default=4,
                   help="decode steps compared per prompt, both runs fed the same tokens; a "
                        "top-1 difference fails the check in float32 and is reported in 16-bit")
    p.add_argument("--near-tie", type=float, default=None,
                   help="flag a prompt whose top-k router margin (k-th minus (k+1)-th logit) "
                        "falls to this x max(1, |k-th logit|) or below anywhere; default 1e-5 "
                        "in float32, 2^-8 in 16-bit dtypes (reported; it excuses no mismatch)")
    from cpmoe.cp.kv_cache import KV_CACHE_DTYPES
    p.add_argument("--reference-kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=None,
                   help="the one-rank reference's --kv-cache-dtype (default: the layout's); "
                        "e.g. --kv-cache-dtype fp8_e4m3 --reference-kv-cache-dtype auto measures "
                        "what FP8 K/V and FP8 attention cost against 16-bit")
    add_context_flag(p)
    add_engine_flags(p, "what each batch needs")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                       formatter_class=_Help)
    add_layout_flags(p)
    add_model_flags(p)
    add_serve_arguments(p)
    add_context_flag(p)
    add_engine_flags(p, "16384 on CPU; --mem-fraction-static on CUDA")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("bench", help="prefill throughput of random-weight models over layouts")
    from cpmoe.bench.run import add_arguments as add_bench_arguments  # not in every rank
    add_bench_arguments(p)
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("bench-one-batch", help="decode of one static batch: ms/step vs the "
                       "HBM roofline and HF transformers (after SGLang's bench_one_batch)")
    add_layout_flags(p)
    from cpmoe.bench.one_batch_run import add_arguments as add_one_batch_arguments
    add_one_batch_arguments(p)
    add_engine_flags(p, "what the largest batch needs")
    p.set_defaults(fn=cmd_bench_one_batch)
    p = sub.add_parser("bench-serving", help="online serving throughput and latency over "
                       "HTTP streaming (after sglang.bench_serving)")
    from cpmoe.bench.serving import add_arguments as add_serving_arguments
    add_serving_arguments(p)
    p.set_defaults(fn=cmd_bench_serving)
    p = sub.add_parser("bench-calibrate", help="measure the rates of plan --estimate on this "
                       "GPU (CUDA; a few minutes) into a calibration file")
    from cpmoe.estimate.calibrate import add_arguments as add_calibrate_arguments
    add_calibrate_arguments(p)
    p.set_defaults(fn=cmd_bench_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit 0; 2 after one `cpmoe: error:` line for bad input (checked before any rank, or
    raised on a rank); 1 after a rank failed (its error); 130 on Ctrl-C (ranks stopped).
    Under torchrun every process runs this: input checked before the ranks meet is the same
    on all of them, so only rank 0 prints it; a peer that lost its partner prints one line."""
    args = build_parser().parse_args(argv)
    rank = torchrun_rank()
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        if not rank:
            print(f"cpmoe: error: {e}", file=sys.stderr)
        else:  # torchrun stops the others when one exits: let rank 0 print first
            time.sleep(TORCHRUN_QUIET_EXIT_S)
        return 2
    except RankFailure as e:
        if isinstance(e.error, USER_ERRORS):  # the same line and exit code as on one rank
            print(f"cpmoe: error: {e.error}", file=sys.stderr)
            return 2
        lost = peer_loss(e.error) if rank is not None else None
        if lost:
            print(f"cpmoe: rank {rank} stopped: a peer rank left the job ({lost}); the root "
                  f"error is in that rank's output", file=sys.stderr)
            return 1
        print(f"cpmoe: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a pool has killed its ranks on the way out
        print("cpmoe: interrupted", file=sys.stderr)
        return 130
