"""`cpmoe` command line: plan / prefill / generate / check / bench / serve.

Everything a user can get wrong (layout flags, model fit, input files) is checked in the
parent process before any rank is spawned; a failure prints one line and exits 2 without
writing output. A failing rank ends the whole job (exit 1) with its error shown; a user
error found on a rank (a broken checkpoint) prints the same one line and exits 2.

`main.py` builds the parser and maps failures to exit codes; `flags.py` holds the shared
flags and their checks; one module per family of commands: `plan.py`, `run.py` (prefill,
generate, check), `serve.py`, `bench.py`.
"""

from cpmoe.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
