"""Scripts run under Triton's CPU interpreter, in one worker process for the whole run.

TRITON_INTERPRET=1 is read when Triton is imported, so these scripts cannot run in the test
process. Each used to start its own interpreter (torch, Triton and cpmoe imported every time,
about 3 CPU-s); the worker imports them once and forks a child per script, so a script still
starts from a clean state and its monkeypatches end with it, as with a process of its own.
`run_interpreted` answers like `subprocess.run(..., capture_output=True, text=True)`.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# One line per script on stdin: "path<TAB>stdout file<TAB>stderr file<TAB>argv...";
# one line back: the child's exit code. Nothing is computed before a fork (no thread yet).
_WORKER = r"""
import os, runpy, sys, traceback
import torch  # noqa: F401 -- imported once, inherited by every script's fork
import cpmoe.engine.runner, cpmoe.moe.fused_moe, cpmoe.ops  # noqa: F401 -- Triton too
for line in sys.stdin:
    path, out, err, *argv = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, out), (2, err)):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [path, *argv]
        code = 0
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""

_worker: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", _WORKER], cwd=REPO_ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True)  # a timeout kills it and its fork


def _stop() -> None:
    if _worker is not None and _worker.poll() is None:
        _worker.stdin.close()  # the loop ends: the worker exits
        try:
            _worker.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(_worker.pid, signal.SIGKILL)


atexit.register(_stop)


def run_interpreted(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `script` (with sys.argv[1:] = argv) under the interpreter -> its exit code and
    output. Past `timeout` seconds the worker is killed and TimeoutError raised."""
    global _worker
    if _worker is None or _worker.poll() is not None:
        _worker = _start()
    work = pathlib.Path(tempfile.mkdtemp(prefix="cpmoe-interpreted-"))
    path, out, err = work / "script.py", work / "stdout", work / "stderr"
    path.write_text(script)
    _worker.stdin.write("\t".join(map(str, (path, out, err, *argv))) + "\n")
    _worker.stdin.flush()
    if not select.select([_worker.stdout], [], [], timeout)[0]:
        os.killpg(_worker.pid, signal.SIGKILL)
        _worker.wait()
        raise TimeoutError(f"interpreted script still running after {timeout} s")
    line = _worker.stdout.readline()
    if not line:  # the worker itself died (an import failed): its stderr is the test's
        raise RuntimeError(f"the interpreter worker exited {_worker.wait()}")
    read = (lambda p: p.read_text(errors="replace") if p.exists() else "")
    return subprocess.CompletedProcess([str(path), *argv], int(line), read(out), read(err))
