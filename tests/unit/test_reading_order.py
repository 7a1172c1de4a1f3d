"""The reading order in cpmoe's package docstring names only what exists: each `path.py` (or
folder/) under cpmoe/, and each `path.py:Name` or `path.py:Class.method` defined there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import cpmoe

PACKAGE = Path(cpmoe.__file__).parent
REF = re.compile(r"`([\w/]+\.py)(?::([\w.]+))?`|`(\w+)\.(prefill|decode|plan)`")


def _defines(path: Path, dotted: str) -> bool:
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = [n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                   ast.AsyncFunctionDef))
                 and n.name == part]
        if not found:
            return False
        scope = found[0].body
    return True


def test_every_name_in_the_reading_order_exists():
    doc = cpmoe.__doc__
    refs = [(m.group(1), m.group(2)) for m in REF.finditer(doc) if m.group(1)]
    assert len(refs) >= 15, refs
    for rel, name in refs:
        path = PACKAGE / rel
        assert path.is_file(), f"cpmoe/{rel} named in cpmoe/__init__.py does not exist"
        if name:
            assert _defines(path, name), f"cpmoe/{rel} defines no {name}"


def test_a_missing_name_is_caught():
    assert not _defines(PACKAGE / "engine/scheduler.py", "Scheduler.no_such_method")
    assert _defines(PACKAGE / "engine/scheduler.py", "Scheduler.plan")
