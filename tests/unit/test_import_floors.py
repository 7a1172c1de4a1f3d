"""Imports flow down the floors of cpmoe: a module imports its own floor or a lower one, never
a higher one, and the modules' imports form no cycle.

Every module under cpmoe/ is parsed with `ast`. For the floors all its imports count (module
level, inside functions, under TYPE_CHECKING), since an import inside a function is still a
dependency. The cycle check reads every import that runs, at module level or inside a
function (deferring an import hides a cycle, it does not remove it), and leaves out the ones
under `if TYPE_CHECKING:`, which only a type checker reads (two classes naming each other).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cpmoe"

# Top to bottom: each floor and the top-level modules and packages of cpmoe on it ("" is
# cpmoe/__init__.py).
FLOORS = (
    ("entry points", ("cli", "check", "serve", "bench", "estimate")),
    ("engine", ("engine",)),
    ("models", ("models", "loader", "default_model")),
    ("communicator", ("communicator",)),
    ("fp8 modules", ("quant",)),
    ("layers", ("cp", "moe", "linear")),
    ("kernels", ("ops", "graph_capture")),
    ("parallel", ("parallel",)),
    ("config", ("config", "context", "_triton", "")),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for level, (_, names) in enumerate(FLOORS):
        if top in names:
            return level
    raise AssertionError(f"{module} is on no floor: add it to FLOORS")


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The cpmoe modules one import statement loads (`from a import b` names a.b when
    a.b is a module, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "cpmoe"]
    base = node.module or ""
    if node.level:
        package = module.split(".") if module in _PACKAGES else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "cpmoe":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


_PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _import_nodes(tree: ast.AST, running_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module: all of them, or (running_only) the ones that can
    run, leaving out the bodies of `if TYPE_CHECKING:`."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif running_only and isinstance(node, ast.If) and _names_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _names_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, *, running_only: bool) -> list[tuple[int, str]]:
    """(line, imported module) for each cpmoe import in `module` (see _import_nodes)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    return sorted({(n.lineno, t) for n in _import_nodes(tree, running_only)
                   for t in _targets(n, module)})


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_module_imports_a_higher_floor():
    upward = []
    for module in MODULES:
        for line, target in imports(module, running_only=False):
            if floor_of(target) < floor_of(module):
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} "
                              f"({FLOORS[floor_of(module)][0]}) imports {target} "
                              f"({FLOORS[floor_of(target)][0]})")
    assert not upward, "imports up the floors:\n" + "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a closed path, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    graph = {m: {t for _, t in imports(m, running_only=True) if t != m} for m in MODULES}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_reads_deferred_imports_and_not_type_checking_ones():
    tree = ast.parse("import cpmoe.a\nif TYPE_CHECKING:\n    import cpmoe.b\nelse:\n"
                     "    import cpmoe.c\ndef f():\n    from cpmoe import d\n")
    running = ["from cpmoe import d", "import cpmoe.a", "import cpmoe.c"]
    assert sorted(map(ast.unparse, _import_nodes(tree, running_only=True))) == running
    assert sorted(map(ast.unparse, _import_nodes(tree, running_only=False))) == sorted(
        running + ["import cpmoe.b"])


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
])
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert _cycle(graph) == cycle


def test_readme_layout_of_the_code_lists_the_floors():
    """README's "Layout of the code" names the floors in this order, and under each floor
    the top-level modules and packages of cpmoe on it."""
    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## Layout of the code\n", 1)[1].split("\n## ", 1)[0]
    names = [name for name, _ in FLOORS]
    floors: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        words = line.split("  ")
        if line.startswith("    ") and words[2].strip() in names:
            current = words[2].strip()
        elif not line.strip():
            current = None
        if current:
            floors[current] = floors.get(current, "") + line
    assert list(floors) == names
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.iterdir()
            if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    for name, modules in FLOORS:
        named = {t for t in tops
                 if re.search(rf"(cpmoe/|\s|, ){t}(\.py|/)", floors[name])}
        assert named == set(modules) - {""}, name
