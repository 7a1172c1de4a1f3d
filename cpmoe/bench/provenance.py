"""Where a result came from: the code, the machine, the software and the exact command.

Every JSON under bench/results/ carries `provenance(argv)` in its header (through
`report.header` or directly), so a figure can be traced to what produced it.

The code is named three ways, because a GPU run may happen in a copy of the tree without its
`.git` folder:
- `git_commit` / `git_dirty` from git when the tree is a checkout; there, dirty means a
  tracked file differs from the commit or a file git does not ignore is untracked (results
  being written under bench/results/ do not count);
- from the environment (`CPMOE_GIT_COMMIT`, `CPMOE_GIT_DIRTY=0|1`) when it is set, said so
  in `git_source` (it wins over git: a copy of the tree may carry a stale `.git`), or null
  when neither is there (never guessed);
- always `source_sha256`, a hash of every .py/.sh file under cpmoe/ and bench/ (path and
  bytes, sorted by path), which `python3 -m cpmoe.bench.provenance --check FILE` recomputes
  for a checkout to say whether a result file was made by the code in front of you.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_SOURCE_DIRS = ("cpmoe", "bench")
_SOURCE_SUFFIXES = (".py", ".sh")
_RESULTS = "bench/results/"


def source_sha256(root: Path = REPO_ROOT) -> str:
    """sha256 over (relative path, bytes) of every .py/.sh file under cpmoe/ and bench/."""
    h = hashlib.sha256()
    files = sorted(p for d in _SOURCE_DIRS for p in (root / d).rglob("*")
                   if p.is_file() and p.suffix in _SOURCE_SUFFIXES
                   and "__pycache__" not in p.parts)
    for p in files:
        rel = p.relative_to(root).as_posix().encode()
        data = p.read_bytes()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state(root: Path = REPO_ROOT, env: dict | None = None) -> dict:
    """-> {git_commit, git_dirty, git_source}: from git, else from the environment, else
    nulls with the reason in git_source."""
    env = os.environ if env is None else env
    if env.get("CPMOE_GIT_COMMIT"):  # said explicitly: a copied tree's .git may be stale
        return _env_state(env)
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is not None and Path(top.strip()).resolve() == root.resolve():
        commit = (_git(root, "rev-parse", "HEAD") or "").strip() or None
        status = _git(root, "status", "--porcelain")
        dirty = None
        if status is not None:
            changed = [ln for ln in status.splitlines()
                       if ln and not ln[3:].lstrip('"').startswith(_RESULTS)]
            dirty = bool(changed)
        return {"git_commit": commit, "git_dirty": dirty, "git_source": "git"}
    return {"git_commit": None, "git_dirty": None,
            "git_source": "unknown: not a git checkout and CPMOE_GIT_COMMIT unset "
                          "(source_sha256 still names the code)"}


def _env_state(env) -> dict:
    flag = env.get("CPMOE_GIT_DIRTY")
    dirty = None if flag not in ("0", "1") else flag == "1"
    return {"git_commit": env["CPMOE_GIT_COMMIT"], "git_dirty": dirty,
            "git_source": "environment (CPMOE_GIT_COMMIT)"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_names() -> list[str]:
    """GPU names from nvidia-smi (no CUDA context in this process: ranks are spawned
    later and want the whole device), else the CPU model."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False)
        names = [n.strip() for n in proc.stdout.splitlines() if n.strip()]
        if proc.returncode == 0 and names:
            return names
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return [line.split(":", 1)[1].strip()]
    except OSError:
        pass
    return [platform.processor() or platform.machine()]


def provenance(argv: list[str] | None = None) -> dict:
    """The provenance fields of a result header. argv: the command as the user typed it
    (default: this process's own command line)."""
    import torch
    process_argv = list(getattr(sys, "orig_argv", sys.argv))
    return {
        "command": shlex.join(argv if argv is not None else process_argv),
        "process_argv": process_argv,
        "cwd": os.getcwd(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **git_state(),
        "source_sha256": source_sha256(),
        "host": platform.node(),
        "devices": _device_names(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": _version("transformers"), "triton": _version("triton"),
        "python": platform.python_version(),
    }


PROVENANCE_KEYS = ("command", "git_commit", "git_dirty", "source_sha256", "devices", "torch",
                   "transformers", "triton", "python")


def check_file(path: Path) -> tuple[bool, str]:
    """Does result file `path` carry provenance, made by the code in this tree?"""
    head = json.loads(path.read_text()).get("header", {})
    missing = [k for k in PROVENANCE_KEYS if k not in head]
    if missing:
        return False, f"{path}: no provenance ({', '.join(missing)} missing)"
    here = source_sha256()
    same = head["source_sha256"] == here
    return same, (f"{path}: commit {head['git_commit']} (dirty {head['git_dirty']}, "
                  f"{head.get('git_source')}); source "
                  f"{'matches this tree' if same else 'differs from this tree'} "
                  f"({head['source_sha256'][:12]} vs {here[:12]}); {head['command']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m cpmoe.bench.provenance",
                                description="print this tree's provenance, or check result "
                                            "files against it")
    p.add_argument("--check", type=Path, nargs="*", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if args.check is None:
        print(json.dumps(provenance(), indent=1))
        return 0
    ok = True
    for path in args.check:
        same, line = check_file(path)
        ok &= same
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
