"""BENCHMARKS.md and bench/results/ hold together, and no tracked text names a unit of work.

What this proves, over the files git tracks (`git ls-files`, so a fresh clone sees the same):
- every `bench/results/...` path BENCHMARKS.md cites in backticks is a tracked file or folder
  (`{a,b}` alternatives and `*` wildcards each match at least one);
- the first table ("Current figures") gives every figure a commit and a command, or says the
  figure is not yet measured on GPU;
- `bench/results/` stays under 5 MB as `du` counts it (each file rounded up to 4 KiB);
- no tracked text file speaks of a numbered or "this/earlier/last ..." unit of work by the
  word for it (the patterns below); HTTP-client and pytest uses of the word do not match.
Skipped outside a git checkout (an sdist, a copied tree).
"""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = "BENCHMARKS.md"
RESULTS = "bench/results/"
LIMIT_BYTES = 5_000_000
BLOCK = 4096
# Built from pieces so this file's own source does not match what it looks for.
_WORD = "sess" + "ion"
_UNIT_OF_WORK = [
    re.compile(rf"\b{_WORD}s?[ -]?\d", re.IGNORECASE),
    re.compile(rf"\b(?:this|that|earlier|last|previous|next|later|prior|same)\s+{_WORD}s?\b",
               re.IGNORECASE),
]
_CITED = re.compile(r"`(" + re.escape(RESULTS) + r"[^`\s]+)`")  # the bare folder names none
_COMMIT = re.compile(r"`[0-9a-f]{7,40}`")
_BINARY_SUFFIXES = (".png", ".gz", ".whl", ".safetensors", ".pt", ".jpg", ".ico")


def _tracked() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    probe = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0 or probe.stdout.strip() != "true":
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True,
                         check=True).stdout.decode()
    # a file deleted in the work tree but not yet committed is not part of a fresh clone's view
    return [p for p in out.split("\0") if p and (REPO_ROOT / p).is_file()]


def expand_braces(pattern: str) -> list[str]:
    """`a-{x,y}-b` -> [`a-x-b`, `a-y-b`]; groups expand left to right, no nesting."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [out for alt in m.group(1).split(",") for out in expand_braces(head + alt + tail)]


def cited_paths(text: str) -> list[str]:
    """Every backticked bench/results path of `text`, alternatives expanded, in order."""
    return [p for cited in _CITED.findall(text) for p in expand_braces(cited)]


def matches_tracked(path: str, tracked: list[str]) -> bool:
    """A folder (trailing /) must hold a tracked file; a file pattern must match one."""
    if path.endswith("/"):
        return any(t.startswith(path) for t in tracked)
    return any(fnmatch.fnmatchcase(t, path) for t in tracked)


def test_expand_braces_and_citations_follow_the_page_syntax() -> None:
    text = ("see `bench/results/p-{a,b}-c.json.gz` and `bench/results/d/`, "
            "not `bench/README.md` nor `.server.log`")
    assert cited_paths(text) == ["bench/results/p-a-c.json.gz", "bench/results/p-b-c.json.gz",
                                 "bench/results/d/"]
    tracked = ["bench/results/p-a-c.json.gz", "bench/results/d/x.txt"]
    assert matches_tracked("bench/results/d/", tracked)
    assert matches_tracked("bench/results/p-*-c.json.gz", tracked)
    assert not matches_tracked("bench/results/p-b-c.json.gz", tracked)


def test_every_cited_result_file_is_tracked() -> None:
    tracked = _tracked()
    cited = cited_paths((REPO_ROOT / PAGE).read_text())
    assert len(cited) > 20, f"{PAGE} cites only {len(cited)} result files"
    missing = sorted({p for p in cited if not matches_tracked(p, tracked)})
    assert not missing, f"{PAGE} cites result files git does not track: {missing}"


def test_first_table_names_a_commit_and_a_command_for_every_figure() -> None:
    text = (REPO_ROOT / PAGE).read_text()
    section = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header
    rows = [r for r in rows if not set(r) <= set("|- ")]
    assert len(rows) >= 15, f"the first table has only {len(rows)} rows"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 7, f"a row of the first table has {len(cells)} cells: {row}"
        figure, result, _date, commit, _machine, command, _file = cells
        if result == "not yet measured on GPU":
            continue
        assert _COMMIT.search(commit), f"no commit for {figure!r}: {commit!r}"
        assert command and command != "-", f"no command for {figure!r}"


def test_results_folder_stays_under_five_megabytes() -> None:
    files = [p for p in _tracked() if p.startswith(RESULTS)]
    on_disk = sum(-(-(REPO_ROOT / p).stat().st_size // BLOCK) * BLOCK for p in files)
    assert on_disk < LIMIT_BYTES, (f"{RESULTS} holds {on_disk / 1e6:.2f} MB in {len(files)} "
                                   f"files, over {LIMIT_BYTES / 1e6:.0f} MB")


def test_no_tracked_text_names_a_unit_of_work_by_that_word() -> None:
    hits: list[str] = []
    for rel in _tracked():
        if rel.endswith(_BINARY_SUFFIXES):
            continue
        data = (REPO_ROOT / rel).read_bytes()
        if b"\0" in data[:8192]:
            continue
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if any(p.search(line) for p in _UNIT_OF_WORK):
                hits.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not hits, "name the commit and the date instead:\n" + "\n".join(hits[:40])
