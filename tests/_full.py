"""The `full` marker (tests/conftest.py skips its cases unless CPMOE_FULL=1 or -m full)."""

from __future__ import annotations

import os

import pytest

FULL = pytest.mark.full
REASON = "full matrix only (CPMOE_FULL=1 runs every case, pytest -m full these ones)"


def full_run(config: pytest.Config) -> bool:
    """Whether this run includes the `full` cases (CPMOE_FULL=1, or -m selecting them)."""
    expr = config.option.markexpr or ""
    return os.environ.get("CPMOE_FULL") == "1" or ("full" in expr and "not full" not in expr)


def full_matrix(cases: list, keep) -> list:
    """cases, with those for which keep(case) is false as pytest.param(case, marks=full)."""
    return [c if keep(c) else pytest.param(c, marks=FULL) for c in cases]
