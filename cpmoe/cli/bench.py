"""`cpmoe bench`, `bench-one-batch`, `bench-serving` and `bench-calibrate`: thin entries into
`cpmoe/bench/` (and `cpmoe/estimate/calibrate.py`), whose `BenchError` (`CalibrationError`)
is the one-line input error here."""

from __future__ import annotations

import argparse
import sys

from cpmoe.cli.flags import InputError, engine_options, layout_from_args


def cmd_bench(args: argparse.Namespace) -> int:
    from cpmoe.bench.run import run_bench
    from cpmoe.bench.spec import BenchError
    try:
        return run_bench(args, ["cpmoe", *sys.argv[1:]])
    except BenchError as e:
        raise InputError(str(e)) from None


def cmd_bench_one_batch(args: argparse.Namespace) -> int:
    from cpmoe.bench.one_batch_run import run_one_batch
    from cpmoe.bench.spec import BenchError
    layout = layout_from_args(args)
    try:
        return run_one_batch(args, layout, engine_options(args), ["cpmoe", *sys.argv[1:]])
    except BenchError as e:
        raise InputError(str(e)) from None


def cmd_bench_serving(args: argparse.Namespace) -> int:
    from cpmoe.bench.serving import run_bench_serving
    from cpmoe.bench.spec import BenchError
    try:
        return run_bench_serving(args, ["cpmoe", *sys.argv[1:]])
    except BenchError as e:
        raise InputError(str(e)) from None


def cmd_bench_calibrate(args: argparse.Namespace) -> int:
    from cpmoe.estimate.calibrate import CalibrationError, run
    try:
        return run(args)
    except CalibrationError as e:
        raise InputError(str(e)) from None
