"""End-to-end tests of the `cpmoe` command line, run as subprocesses (`python -m cpmoe.cli`).

Every call gets `--device cpu`, a timeout, `CPMOE_CACHE_DIR` pointing at a temporary folder
(the built-in default model is built there once) and two test-only environment entries:

- `CPMOE_E2E_MARKER=<unique id>`: inherited by every process the call starts, so a /proc scan
  finds exactly that call's processes (ranks included);
- `CPMOE_E2E_SPAWN_LOG=<folder>` with a `sitecustomize.py` on PYTHONPATH that writes one file
  per Python interpreter started: the CLI itself, each helper it starts (resource tracker,
  the ranks' forkserver), and one per process forked from an interpreter (a rank on cpu is a
  fork of the forkserver: its file reads "fork: <the forkserver's cmdline>").
  "No rank was spawned" is then a fact read from that folder, not a timing guess.
  The same file is the fault injection of the fail-fast tests: with `CPMOE_E2E_FAULT=r:l`,
  rank r's Qwen decoder layer l raises (the product code has no test hook).

Each subprocess costs an interpreter + torch import (and each multi-rank call one more: its
ranks' forkserver, whose forks the ranks are), so calls are grouped: all calls that spawn no
ranks run concurrently in one module fixture (most refused layouts and inputs as
`cpmoe.cli.main` calls in the test process, with process starts trapped: `Cli.in_process`),
the short multi-rank calls in a second one; the fault-injection run and the 4K-16K sweep run
alone (the first has a fail-fast bound, the second is measured and reported).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing.process
import os
import re
import subprocess
import sys
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cpmoe.cli.run import escape_text
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
from tests._full import FULL, full_run
from tests.e2e._serve_helpers import FORKSERVER, marked_processes, marked_ranks

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256  # the conftest checkpoints
QUICK_TIMEOUT_S = 180
MULTI_TIMEOUT_S = 400
SWEEP_TIMEOUT_S = 1200
QUICK_WORKERS = 4
MULTI_WORKERS = 2

SITECUSTOMIZE = '''\
import os
_log = os.environ.get("CPMOE_E2E_SPAWN_LOG")


def _log_start(prefix=""):
    try:
        with open("/proc/self/cmdline", "rb") as _f:
            _cmd = _f.read().replace(b"\\0", b" ").decode(errors="replace")
        with open(os.path.join(_log, str(os.getpid())), "w") as _f:
            _f.write(prefix + _cmd)
    except OSError:
        pass


if _log:
    _log_start()
    os.register_at_fork(after_in_child=lambda: _log_start("fork: "))
_fault = os.environ.get("CPMOE_E2E_FAULT")  # "rank:layer": that rank's Qwen layer raises
with open("/proc/self/cmdline", "rb") as _f:
    _helper = b"resource_tracker" in _f.read()  # it never runs a model: no torch import
if _fault and not _helper:
    from cpmoe.models.qwen_moe import model as _qwen
    _rank, _layer = map(int, _fault.split(":"))
    _forward = _qwen.QwenMoeDecoderLayer.forward

    def _failing(self, *args, **kwargs):
        if self.layer == _layer and self.layer_communicator.groups.rank == _rank:
            raise RuntimeError(f"injected fault at layer {_layer} (CPMOE_E2E_FAULT={_fault})")
        return _forward(self, *args, **kwargs)
    _qwen.QwenMoeDecoderLayer.forward = _failing
'''


# ---- running the CLI ----------------------------------------------------------------------

@dataclass
class CliResult:
    args: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    marker: str
    spawn_log: Path | None  # None: run in this process (Cli.in_process)
    started: list[str] = field(default_factory=list)  # in this process: what it tried to start

    def interpreters(self) -> list[str]:
        """Command lines of every Python interpreter this call started (itself included)."""
        if self.spawn_log is None:
            return ["cpmoe.cli main() in the test process", *self.started]
        return [p.read_text() for p in sorted(self.spawn_log.iterdir())]

    def ranks_spawned(self) -> int:
        if self.spawn_log is None:  # every start was refused: count the attempts
            return len(self.started)
        return sum("spawn_main" in cmd or (cmd.startswith("fork: ") and FORKSERVER in cmd)
                   for cmd in self.interpreters())

    def describe(self) -> str:
        return (f"cpmoe {' '.join(self.args)}\n  exit {self.returncode}\n"
                f"  stdout: {self.stdout[-2000:]!r}\n  stderr: {self.stderr[-3000:]!r}")


class Cli:
    def __init__(self, workdir: Path, cache_dir: Path) -> None:
        self.workdir, self.cache_dir = workdir, cache_dir
        self.site_dir = workdir / "site"
        self.site_dir.mkdir(parents=True, exist_ok=True)
        (self.site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def __call__(self, *args: str, env: dict[str, str] | None = None,
                 timeout: float = QUICK_TIMEOUT_S) -> CliResult:
        marker = uuid.uuid4().hex
        spawn_log = self.workdir / f"spawn-{marker}"
        spawn_log.mkdir()
        full_env = {**os.environ, **(env or {}),
                    "CPMOE_CACHE_DIR": str(self.cache_dir),
                    "PYTHONPATH": os.pathsep.join([str(self.site_dir), str(REPO_ROOT)]),
                    "CPMOE_E2E_MARKER": marker, "CPMOE_E2E_SPAWN_LOG": str(spawn_log)}
        argv = [*map(str, args), "--device", "cpu"]
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "cpmoe.cli", *argv], env=full_env,
                              cwd=str(REPO_ROOT), capture_output=True, timeout=timeout,
                              check=False)
        elapsed = time.monotonic() - t0
        # Bytes, not text=True: universal newlines would turn a progress bar's '\r' into '\n'.
        return CliResult(argv, proc.returncode, decode(proc.stdout), decode(proc.stderr),
                         elapsed, marker, spawn_log)

    def in_process(self, *args: str) -> CliResult:
        """`cpmoe.cli.main` called here (no interpreter, no torch import: for input refused
        before any work). Starting a process or a subprocess raises, and is recorded in
        `started`, so "nothing was spawned" is checked as with the spawn log."""
        from cpmoe.cli import main
        argv = [*map(str, args), "--device", "cpu"]
        out, err, started = io.StringIO(), io.StringIO(), []

        def refuse(obj, *_, **__):
            started.append(f"{type(obj).__name__} (refused by the test)")
            raise RuntimeError("test: cpmoe tried to start a process")

        t0 = time.monotonic()
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            mp.setenv("CPMOE_CACHE_DIR", str(self.cache_dir))
            mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
            mp.setattr(subprocess.Popen, "__init__", refuse)
            try:
                code = main(argv)
            except SystemExit as e:  # argparse
                code = e.code
            except Exception:  # noqa: BLE001 -- shown by describe()
                traceback.print_exc()
                code = None
        return CliResult(argv, code, out.getvalue(), err.getvalue(), time.monotonic() - t0,
                         "", None, started)

    def many(self, calls: dict[str, tuple], workers: int,
             timeout: float = QUICK_TIMEOUT_S) -> dict[str, CliResult]:
        """Run named calls concurrently: name -> (args tuple[, env dict])."""
        def one(spec: tuple) -> CliResult:
            args, env = (spec[0], spec[1]) if len(spec) == 2 else (spec[0], None)
            return self(*args, env=env, timeout=timeout)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {name: pool.submit(one, spec) for name, spec in calls.items()}
            return {name: f.result() for name, f in futures.items()}


def decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n")


def shown_lines(stderr: str) -> list[str]:
    """stderr lines as a terminal shows them: a progress bar redrawn with '\\r' and then
    overwritten leaves only the text after its last '\\r'."""
    return [line.rsplit("\r", 1)[-1] for line in stderr.split("\n") if line.rsplit("\r", 1)[-1]]


def report(request: pytest.FixtureRequest, text: str) -> None:
    """Show a line in pytest's normal output (measured times)."""
    plugins = request.config.pluginmanager
    reporter, capman = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capman is not None:
        with capman.global_and_fixture_disabled():  # else the line is captured and dropped
            reporter.write_line(f"\n[e2e] {text}")


def assert_user_error(res: CliResult, flag: str, out: Path | None = None) -> None:
    """Exit 2, one `cpmoe: error:` line naming `flag` on stderr, no stdout, no output file,
    and no rank ever spawned (only the CLI's own interpreter started)."""
    lines = res.stderr.splitlines()
    assert res.returncode == 2, res.describe()
    assert len(lines) == 1, res.describe()
    assert lines[0].startswith("cpmoe: error: "), res.describe()
    assert flag in lines[0], f"{flag!r} not named\n{res.describe()}"
    assert res.stdout == "", res.describe()
    if out is not None:
        assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
    interpreters = res.interpreters()
    assert len(interpreters) == 1 and "cpmoe.cli" in interpreters[0], \
        f"processes started: {interpreters}\n{res.describe()}"


CHECK_LINE = re.compile(r"^first-token matches: (\d+)/(\d+)$", re.MULTILINE)
DIFF_LINE = re.compile(r"^max \|logit diff\|: (\S+)$", re.MULTILINE)
LAYOUT_LINE = re.compile(r"^layout: (\{.*\})$", re.MULTILINE)


def parse_check(res: CliResult) -> tuple[int, int, float, dict]:
    m, d, lay = (CHECK_LINE.search(res.stdout), DIFF_LINE.search(res.stdout),
                 LAYOUT_LINE.search(res.stdout))
    assert m and d and lay, res.describe()
    return int(m[1]), int(m[2]), float(d[1]), json.loads(lay[1])


def runner_of(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, ProcessGroups.single(), torch.float32, show_progress=False)


# ---- shared inputs --------------------------------------------------------------------------

PREFILL_LENGTHS = (1, 7, 40)
TP4_CP2_EP4 = ("--tp-size", "4", "--attn-cp-size", "2", "--ep-size", "4")
TP2_CP2_EP2 = ("--tp-size", "2", "--attn-cp-size", "2", "--ep-size", "2")
SPARSE_DEFAULT_LAYERS = 4  # the built-in model: 4 layers, all sparse

INVALID_LAYOUTS = {  # name -> (flags, the flag the error line must name)
    "cp-not-dividing-tp": (("--tp-size", "4", "--attn-cp-size", "3"), "--attn-cp-size"),
    "moe-dp-not-1-or-cp": (("--moe-dp-size", "2", "--attn-cp-size", "4", "--tp-size", "8"),
                           "--moe-dp-size"),
    "ep-not-dividing-tp": (("--ep-size", "3", "--tp-size", "4"), "--ep-size"),
    "coupled-ep-times-dp-not-tp": (("--tp-size", "8", "--attn-cp-size", "2", "--moe-dp-size",
                                    "2", "--ep-size", "2"), "--moe-dp-size"),
    "alltoall-ep-x-moe-tp": (("--moe-a2a-backend", "alltoall", "--tp-size", "4", "--ep-size",
                              "2"), "--moe-a2a-backend"),
    "alltoall-ep-not-tp": (("--moe-a2a-backend", "alltoall", "--tp-size", "4", "--ep-size",
                            "1"), "--moe-a2a-backend"),
    "attention-dp": (("--dp-size", "2"), "--dp-size"),
    "deepep-missing": (("--moe-a2a-backend", "deepep", "--tp-size", "2", "--ep-size", "2"),
                       "--moe-a2a-backend"),
    "experts-not-divisible-by-ep": (("--tp-size", "16", "--ep-size", "16", "--model", "{q3}"),
                                    "--ep-size"),
}

BAD_INPUTS = {  # name -> (file text or None for a missing file, substrings the line must have)
    "not-json": ("[[1, 2", ("not JSON",)),
    "empty-list": ("[]", ("non-empty JSON list",)),
    "not-a-list": ('{"ids": [1, 2]}', ("non-empty JSON list",)),
    "empty-sequence": ("[[1, 2], []]", ("sequence 1", "non-empty list")),
    "id-too-large": (f"[[1, 2], [3, {VOCAB}]]", ("sequence 1", f"{VOCAB}", f"[0, {VOCAB})")),
    "negative-id": ("[[-1, 2]]", ("sequence 0", "-1")),
    "non-integer": ("[[1, 2.5]]", ("sequence 0", "2.5")),
    "boolean-id": ("[[1, true]]", ("sequence 0", "True")),
    "missing-file": (None, ("cannot read",)),
}


def seqs_for_prefill() -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PREFILL_LENGTHS]


# ---- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def default_model_dir(workdir, default_model_cache) -> Path:
    """The built-in model in the cache folder every CLI call is pointed at (a copy of the
    session's build: tests/conftest.py)."""
    return default_model_cache(workdir / "cache")


@pytest.fixture(scope="module")
def cli(workdir, default_model_dir) -> Cli:
    return Cli(workdir, workdir / "cache")


@pytest.fixture(scope="module")
def ids_file(workdir) -> Path:
    path = workdir / "ids.json"
    path.write_text(json.dumps(seqs_for_prefill()))
    return path


# Refused layouts and inputs checked through a real interpreter (its spawn log): a layout
# refused by plan and a prefill input refused after the model's config is read; the other
# refusals (the same code paths with other flags) call cpmoe.cli.main in the test process
# (about 4 CPU-s less each), where starting any process fails the call.
SPAWNED_CHECKS = {"bad-layout-plan-cp-not-dividing-tp", "bad-input-id-too-large"}
# `plan` (no rank, no weights) runs as a real command for the demo layout (--json and text);
# its other layouts are read from main() in this process
IN_PROCESS_PLANS = {"plan-alltoall", "plan-coupled", "plan-q3", "plan-q3-ep8", "plan-q3-fp8kv"}
# One-rank prefill and generate run the model in the CLI's own process (no rank): main() in
# this process runs the same code, without an interpreter and torch import each (about 3
# CPU-s); the real command is met by `plan`, the refusals above and every multi-rank call.
IN_PROCESS_ONE_RANK = {"prefill-1rank", "generate-ids-1rank", "generate-default-1rank"}


@pytest.fixture(scope="module")
def quick(cli, workdir, ids_file, qwen3_moe_dir, v4_dir) -> dict[str, CliResult]:
    """Every call that must not (or need not) spawn ranks, run concurrently (the refusals
    not in SPAWNED_CHECKS: one after another in this process)."""
    q3 = str(qwen3_moe_dir)
    calls: dict[str, tuple] = {
        "plan": (("plan", *TP4_CP2_EP4, "--json"),),
        "plan-text": (("plan", *TP4_CP2_EP4),),
        "plan-alltoall": (("plan", "--moe-a2a-backend", "alltoall", "--ep-size", "4",
                           "--tp-size", "4", "--attn-cp-size", "2", "--json"),),
        "plan-coupled": (("plan", "--tp-size", "4", "--attn-cp-size", "2", "--moe-dp-size", "2",
                          "--ep-size", "2", "--json"),),
        "plan-q3": (("plan", "--model", q3, *TP4_CP2_EP4, "--json"),),
        "plan-q3-ep8": (("plan", "--model", q3, "--tp-size", "8", "--ep-size", "8", "--json"),),
        "plan-q3-fp8kv": (("plan", "--model", q3, *TP4_CP2_EP4, "--kv-cache-dtype",
                           "fp8_e4m3", "--json"),),
        "prefill-1rank": (("prefill", "--model", q3, "--input-ids-file", ids_file,
                           "--dump-logits", workdir / "logits-1rank.safetensors"),),
        "generate-ids-1rank": (("generate", "--model", q3, "--input-ids", "1,2,3",
                                "--max-new-tokens", "5"),),
        "generate-default-1rank": (("generate", "--prompt", "Hello", "--max-new-tokens", "4"),),
    }
    for name, (flags, _) in INVALID_LAYOUTS.items():
        flags = tuple(f.format(q3=q3) for f in flags)
        calls[f"bad-layout-plan-{name}"] = (("plan", *flags, "--json"),)
        calls[f"bad-layout-prefill-{name}"] = (
            ("prefill", *flags, "--input-ids-file", ids_file,
             "--dump-logits", workdir / f"bad-layout-{name}.safetensors"),)
    for name, (text, _) in BAD_INPUTS.items():
        path = workdir / f"bad-input-{name}.json"
        if text is not None:
            path.write_text(text)
        calls[f"bad-input-{name}"] = (
            ("prefill", "--model", q3, *TP2_CP2_EP2, "--input-ids-file", path,
             "--dump-logits", workdir / f"bad-input-{name}.safetensors"),)
    calls["generate-does-not-fit"] = (("generate", "--model", q3, *TP2_CP2_EP2, "--input-ids",
                                       ",".join(["7"] * 40), "--max-new-tokens", "8",
                                       "--max-total-tokens", "20"),)
    calls["bad-kv-cache-dtype-v4"] = (("generate", "--model", v4_dir, "--input-ids", "1,2,3",
                                       "--max-new-tokens", "2", "--kv-cache-dtype",
                                       "fp8_e4m3"),)
    calls["bad-dump-folder"] = (("prefill", "--model", q3, *TP2_CP2_EP2, "--input-ids-file",
                                 ids_file, "--dump-logits",
                                 workdir / "no-such-folder" / "out.safetensors"),)
    (workdir / "existing-dir").mkdir()
    calls["dump-is-a-dir"] = (("prefill", "--model", q3, "--input-ids-file", ids_file,
                               "--dump-logits", workdir / "existing-dir"),)
    here = {k: v for k, v in calls.items()
            if (k.startswith("bad-") and k not in SPAWNED_CHECKS)
            or k in IN_PROCESS_PLANS | IN_PROCESS_ONE_RANK}
    done = cli.many({k: v for k, v in calls.items() if k not in here}, QUICK_WORKERS)
    return {**done, **{k: cli.in_process(*args) for k, (args,) in here.items()}}


@pytest.fixture(scope="module")
def v4_dir(workdir) -> Path:
    from tests.distributed._v4_tasks import make_v4_model
    return make_v4_model("base", workdir / "deepseek_v4")[1]


# prompts per `cpmoe check` call: each length (17, 64, 129) twice (the count is not what is
# tested; 40 made each call's prefill 2.8K tokens on both sides, 12 took 1.1K)
CHECK_PROMPTS = 6
# `cpmoe check` layouts run only with CPMOE_FULL=1 (layout correctness is test_layouts' and
# test_decode's; the default keeps the command at 4 ranks and the V4 one at 2). The 8-rank
# calls are 9 interpreters each; 8 ranks with alltoall are compared with one rank by
# test_decode[tp8-cp4-dp1-ep8-alltoall], attn-cp 8 by test_layouts[tp8-cp8-dp1-ep8-none-zigzag]
FULL_CHECKS = {"check-tp8-cp4-ep8", "check-tp4-cp2-dp2-ep2", "check-tp8-cp8-ep8-alltoall"}


@pytest.fixture(scope="module")
def multi(request, cli, workdir, ids_file, qwen3_moe_dir, v4_dir) -> dict[str, CliResult]:
    """The short multi-rank calls, run a few at a time."""
    q3 = str(qwen3_moe_dir)
    check = ("check", "--model", q3, "--prompts", str(CHECK_PROMPTS), "--lengths", "17,64,129")
    calls: dict[str, tuple] = {
        "check-tp8-cp4-ep8": ((*check, "--tp-size", "8", "--attn-cp-size", "4",
                               "--ep-size", "8"),),
        # 200 tokens: 50 CSA entries, past the indexer's top-32 (its margins are measured)
        "check-v4-tp2-cp2-ep2": (("check", "--model", v4_dir, "--prompts", str(CHECK_PROMPTS),
                                  "--lengths", "17,64,200", *TP2_CP2_EP2, "--cp-strategy",
                                  "interleave"),),
        "check-tp8-cp8-ep8-alltoall": ((*check, "--tp-size", "8", "--attn-cp-size", "8",
                                        "--ep-size", "8", "--moe-a2a-backend", "alltoall"),),
        "prefill-tp4": (("prefill", "--model", q3, *TP4_CP2_EP4, "--input-ids-file", ids_file,
                         "--dump-logits", workdir / "logits-tp4.safetensors"),),
        # batches of 210 tokens (one prompt of each length: 2 batches) and 3 decode steps:
        # what test_check_reports_progress_decode_and_routing_margins_per_prompt reads
        "check-tp4-cp2-ep4": ((*check, *TP4_CP2_EP4, "--max-batch-tokens", "210",
                               "--decode-steps", "3"),),
        # FP8 K/V pools against a 16-bit reference: a measurement, exit 0 whatever agrees
        "check-fp8-kv-vs-auto": (("check", "--model", q3, "--prompts", "3", "--lengths",
                                  "17,64,129", *TP2_CP2_EP2, "--kv-cache-dtype", "fp8_e4m3",
                                  "--reference-kv-cache-dtype", "auto"),),
        "check-tp4-cp2-dp2-ep2": ((*check, "--tp-size", "4", "--attn-cp-size", "2",
                                   "--moe-dp-size", "2", "--ep-size", "2"),),
        "generate-default-tp2": (("generate", "--prompt", "Hello", "--max-new-tokens", "4",
                                  *TP2_CP2_EP2),),
    }
    if not full_run(request.config):
        calls = {k: v for k, v in calls.items() if k not in FULL_CHECKS}
    return cli.many(calls, MULTI_WORKERS, timeout=MULTI_TIMEOUT_S)


# ---- plan ------------------------------------------------------------------------------------

REQUIRED_SIZES = ("world_size", "attn_tp_size", "attn_cp_size", "moe_ep_size", "moe_tp_size",
                  "moe_dp_size")


def plan_json(res: CliResult) -> dict:
    assert res.returncode == 0, res.describe()
    out = json.loads(res.stdout)  # the whole stdout is one JSON document...
    assert isinstance(out, dict), res.describe()  # ...and it is an object
    return out


def test_plan_json_sizes_groups_and_layer_modes(quick):
    out = plan_json(quick["plan"])
    assert {k: out[k] for k in REQUIRED_SIZES} == {
        "world_size": 4, "attn_tp_size": 2, "attn_cp_size": 2, "moe_ep_size": 4,
        "moe_tp_size": 1, "moe_dp_size": 1}
    groups = out["groups"]
    assert {"attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp"} <= set(groups)
    assert groups["attn_tp"] == [[0, 1], [2, 3]]
    assert groups["attn_cp"] == [[0, 2], [1, 3]]
    assert groups["moe_ep"] == [[0, 1, 2, 3]]
    assert groups["moe_tp"] == [[0], [1], [2], [3]]
    assert groups["moe_dp"] == [[0, 2], [1, 3]]  # decoupled: MoE-DP is the CP group
    assert out["layer_modes"] == [
        {"layer": i, "sparse": True, "attn": "TP_ATTN_FULL", "mlp": "MOE_FULL"}
        for i in range(SPARSE_DEFAULT_LAYERS)]


def test_plan_text_output(quick):
    res = quick["plan-text"]
    assert res.returncode == 0, res.describe()
    assert "cpmoe-tiny-qwen3-moe" in res.stdout
    assert "attn_cp  [0, 2] [1, 3]" in res.stdout, res.describe()
    assert "attention TP_ATTN_FULL, mlp MOE_FULL" in res.stdout, res.describe()


def test_plan_alltoall_is_scattered(quick):
    out = plan_json(quick["plan-alltoall"])
    assert out["moe_a2a_backend"] == "alltoall"
    assert [m["mlp"] for m in out["layer_modes"]] == ["SCATTERED"] * SPARSE_DEFAULT_LAYERS
    assert {m["attn"] for m in out["layer_modes"]} == {"TP_ATTN_FULL"}


def test_plan_coupled_moe_dp_is_full(quick):
    out = plan_json(quick["plan-coupled"])
    assert (out["moe_dp_size"], out["moe_ep_size"], out["moe_tp_size"]) == (2, 2, 1)
    assert out["groups"]["moe_ep"] == [[0, 1], [2, 3]]
    assert out["groups"]["moe_dp"] == [[0, 2], [1, 3]]
    assert [m["mlp"] for m in out["layer_modes"]] == ["FULL"] * SPARSE_DEFAULT_LAYERS


def test_plan_model_with_dense_layer(quick):
    out = plan_json(quick["plan-q3"])  # mlp_only_layers=[1]
    assert out["layer_modes"] == [
        {"layer": 0, "sparse": True, "attn": "TP_ATTN_FULL", "mlp": "MOE_FULL"},
        {"layer": 1, "sparse": False, "attn": "TP_ATTN_FULL", "mlp": "TP_ATTN_FULL"},
        {"layer": 2, "sparse": True, "attn": "TP_ATTN_FULL", "mlp": "MOE_FULL"}]


def test_plan_fp8_kv_cache_is_a_byte_an_element(quick):
    """--kv-cache-dtype fp8_e4m3: a quarter of float32's KV bytes per token, on every rank."""
    fp8, plain = plan_json(quick["plan-q3-fp8kv"]), plan_json(quick["plan-q3"])
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and plain["kv_cache_dtype"] == "auto"
    assert [m["kv_bytes_per_token"] * 4 for m in fp8["memory_per_rank"]] == [
        m["kv_bytes_per_token"] for m in plain["memory_per_rank"]]


def test_fp8_kv_cache_refused_for_a_model_with_its_own_caches(quick):
    res = quick["bad-kv-cache-dtype-v4"]
    assert_user_error(res, "--kv-cache-dtype fp8_e4m3")
    assert "DeepSeek-V4" in res.stderr


def test_plan_model_fit_ok(quick):
    out = plan_json(quick["plan-q3-ep8"])  # 8 experts over 8 EP ranks
    assert (out["world_size"], out["moe_ep_size"], out["attn_tp_size"]) == (8, 8, 8)


# ---- plan --json of EP x MoE-TP layouts against SGLang's group formulas ------------------------

# (tp, attn_cp, ep) with moe_dp 1: the layouts issue 17 adds
HYBRID = [(4, 1, 2), (4, 2, 2), (8, 2, 4), (8, 4, 2)]


def sglang_groups(tp: int, cp: int, ep: int, moe_dp: int = 1) -> dict[str, list[list[int]]]:
    """Groups as SGLang's initialize_model_parallel builds them for one TP group (its loops
    restated, not cpmoe's coordinate formulas): MoE-EP groups start at every (moe_dp block,
    moe_tp offset) and stride moe_tp; MoE-TP groups are contiguous runs of moe_tp; attention
    TP groups contiguous runs of attn_tp, attention CP groups stride attn_tp."""
    moe_tp, attn_tp = tp // ep // moe_dp, tp // cp
    moe_ep = [list(range(d * ep * moe_tp + t, (d + 1) * ep * moe_tp, moe_tp))
              for d in range(moe_dp) for t in range(moe_tp)]
    moe_tp_groups = [list(range(i * moe_tp, (i + 1) * moe_tp)) for i in range(ep * moe_dp)]
    attn_tp_groups = [list(range(i * attn_tp, (i + 1) * attn_tp)) for i in range(cp)]
    attn_cp = [list(range(j, tp, attn_tp)) for j in range(attn_tp)]
    return {"moe_ep": sorted(moe_ep), "moe_tp": moe_tp_groups, "attn_tp": attn_tp_groups,
            "attn_cp": attn_cp}


@pytest.fixture(scope="module")
def hybrid_plans(cli) -> dict[tuple[int, int, int], CliResult]:
    """plan --json from main() in this process (test_plan_json_* runs the real command)."""
    return {(tp, cp, ep): cli.in_process("plan", "--tp-size", str(tp), "--attn-cp-size",
                                         str(cp), "--ep-size", str(ep), "--json")
            for tp, cp, ep in HYBRID}


@pytest.mark.parametrize("tp, cp, ep", HYBRID, ids=[f"tp{t}-cp{c}-ep{e}" for t, c, e in HYBRID])
def test_plan_json_hybrid_groups_equal_sglang_formulas(hybrid_plans, tp, cp, ep):
    out = plan_json(hybrid_plans[(tp, cp, ep)])
    assert {k: out[k] for k in REQUIRED_SIZES} == {
        "world_size": tp, "attn_tp_size": tp // cp, "attn_cp_size": cp, "moe_ep_size": ep,
        "moe_tp_size": tp // ep, "moe_dp_size": 1}
    want = sglang_groups(tp, cp, ep)
    for kind, groups in want.items():
        assert out["groups"][kind] == groups, kind
    # decoupled MoE-DP is the CP group; the MoE group is the whole TP group (EP x MoE-TP)
    assert out["groups"]["moe_dp"] == (want["attn_cp"] if cp > 1 else [[r] for r in range(tp)])
    assert out["groups"]["moe"] == [list(range(tp))]
    mlp = "MOE_FULL" if cp > 1 else "FULL"
    assert [m["mlp"] for m in out["layer_modes"]] == [mlp] * SPARSE_DEFAULT_LAYERS


def test_sglang_formulas_restated_match_the_reference_examples():
    """The restated formulas agree with the reference's worked examples (they are the oracle
    of the test above, so they are checked against numbers written out by hand)."""
    assert sglang_groups(4, 2, 4) == {"moe_ep": [[0, 1, 2, 3]], "moe_tp": [[0], [1], [2], [3]],
                                      "attn_tp": [[0, 1], [2, 3]], "attn_cp": [[0, 2], [1, 3]]}
    assert sglang_groups(4, 2, 2, moe_dp=2)["moe_ep"] == [[0, 1], [2, 3]]
    assert sglang_groups(8, 2, 4)["moe_ep"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sglang_groups(8, 2, 4)["moe_tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


# ---- user errors: exit 2, one line, nothing spawned or written ------------------------------

@pytest.mark.parametrize("command", ["plan", "prefill"])
@pytest.mark.parametrize("name", list(INVALID_LAYOUTS))
def test_invalid_layout(quick, workdir, command, name):
    flag = INVALID_LAYOUTS[name][1]
    out = workdir / f"bad-layout-{name}.safetensors" if command == "prefill" else None
    assert_user_error(quick[f"bad-layout-{command}-{name}"], flag, out)


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_prefill_input(quick, workdir, name):
    res = quick[f"bad-input-{name}"]
    path = workdir / f"bad-input-{name}.json"
    assert_user_error(res, f"--input-ids-file {path}",
                      workdir / f"bad-input-{name}.safetensors")
    for text in BAD_INPUTS[name][1]:
        assert text in res.stderr, f"{text!r} not in the error line\n{res.describe()}"


def test_generate_that_cannot_fit_the_kv_cache_is_refused_before_any_work(quick):
    res = quick["generate-does-not-fit"]
    assert_user_error(res, "--max-total-tokens")
    assert "KV slots" in res.stderr


def test_bad_dump_folder(quick, workdir):
    assert_user_error(quick["bad-dump-folder"], "--dump-logits")
    assert not (workdir / "no-such-folder").exists()


def test_dump_logits_to_a_directory(quick, workdir):
    res = quick["dump-is-a-dir"]
    out = workdir / "existing-dir"
    assert out.is_dir() and not any(out.iterdir())  # the directory itself is untouched
    assert_user_error(res, "--dump-logits")
    assert not out.with_name(out.name + ".tmp").exists()


# ---- prefill ---------------------------------------------------------------------------------

def read_logits(path: Path) -> list[torch.Tensor]:
    tensors = load_file(str(path))
    assert set(tensors) == {f"logits.{i}" for i in range(len(PREFILL_LENGTHS))}
    out = [tensors[f"logits.{i}"] for i in range(len(PREFILL_LENGTHS))]
    for t, n in zip(out, PREFILL_LENGTHS):
        assert t.dtype == torch.float32 and tuple(t.shape) == (n, VOCAB)
    return out


def test_prefill_one_rank_equals_in_process(quick, workdir, qwen3_moe_dir):
    res = quick["prefill-1rank"]
    assert res.returncode == 0, res.describe()
    assert res.stdout == (f"wrote logits of {len(PREFILL_LENGTHS)} sequence(s) to "
                          f"{workdir / 'logits-1rank.safetensors'}\n")
    got = read_logits(workdir / "logits-1rank.safetensors")
    want = runner_of(qwen3_moe_dir).prefill(seqs_for_prefill()).split(list(PREFILL_LENGTHS))
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g - w).abs().max().item() <= 1e-6, f"sequence {i}"
    assert not (workdir / "logits-1rank.safetensors.tmp").exists()


def test_prefill_tp4_cp2_ep4_equals_one_rank(quick, multi, workdir):
    res = multi["prefill-tp4"]
    assert res.returncode == 0, res.describe()
    assert res.ranks_spawned() == 4, res.interpreters()
    one = read_logits(workdir / "logits-1rank.safetensors")
    four = read_logits(workdir / "logits-tp4.safetensors")
    for i, (a, b) in enumerate(zip(one, four)):
        assert (a - b).abs().max().item() <= 1e-5, f"sequence {i}"


# ---- generate --------------------------------------------------------------------------------

def test_generate_input_ids_equals_in_process(quick, qwen3_moe_dir):
    res = quick["generate-ids-1rank"]
    assert res.returncode == 0, res.describe()
    runner = runner_of(qwen3_moe_dir)
    want = generate(runner, [[1, 2, 3]], 5, runner.config.eos_token_ids)[0]
    assert len(want) == 5
    assert res.stdout == ",".join(map(str, want)) + "\n", res.describe()


def test_generate_prompt_on_default_model(quick, default_model_dir):
    from transformers import AutoTokenizer
    res = quick["generate-default-1rank"]
    assert res.returncode == 0, res.describe()
    assert res.stdout.strip(), res.describe()
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    runner = runner_of(default_model_dir)
    new = generate(runner, [tok.encode("Hello")], 4, runner.config.eos_token_ids)[0]
    assert 1 <= len(new) <= 4
    assert res.stdout == escape_text(tok.decode(new)) + "\n", res.describe()


def test_generate_tp2_cp2_ep2_equals_one_rank(quick, multi):
    one, two = quick["generate-default-1rank"], multi["generate-default-tp2"]
    assert two.returncode == 0, two.describe()
    assert two.ranks_spawned() == 2, two.interpreters()
    assert two.stdout == one.stdout


# ---- check -----------------------------------------------------------------------------------

CHECKS = [
    ("check-tp4-cp2-ep4",
     {"world_size": 4, "attn_cp_size": 2, "moe_ep_size": 4, "moe_dp_size": 1}),
    ("check-tp4-cp2-dp2-ep2",
     {"world_size": 4, "attn_cp_size": 2, "moe_ep_size": 2, "moe_dp_size": 2}),
    ("check-tp8-cp8-ep8-alltoall",
     {"world_size": 8, "attn_cp_size": 8, "moe_ep_size": 8, "moe_dp_size": 1,
      "moe_a2a_backend": "alltoall"}),
    ("check-tp8-cp4-ep8",
     {"world_size": 8, "attn_cp_size": 4, "moe_ep_size": 8, "moe_dp_size": 1}),
    ("check-v4-tp2-cp2-ep2",
     {"world_size": 2, "attn_cp_size": 2, "moe_ep_size": 2, "cp_strategy": "interleave"}),
]


@pytest.mark.parametrize("name, sizes", [pytest.param(*c, marks=FULL) if c[0] in FULL_CHECKS
                                         else c for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_check_layout(multi, name, sizes):
    res = multi[name]
    assert res.returncode == 0, res.describe()
    assert f"first-token matches: {CHECK_PROMPTS}/{CHECK_PROMPTS}\n" in res.stdout, \
        res.describe()
    matches, prompts, diff, layout = parse_check(res)
    assert (matches, prompts) == (CHECK_PROMPTS, CHECK_PROMPTS)
    assert diff <= 1e-5, res.describe()
    assert {k: layout[k] for k in sizes} == sizes
    assert res.ranks_spawned() == sizes["world_size"]


def test_check_reports_progress_decode_and_routing_margins_per_prompt(multi):
    """What `cpmoe check` prints besides the verdict: a progress line per batch (stderr) and,
    per prompt, its routing margin and decode steps (the tp4 cp2 ep4 run: batches of 3)."""
    res = multi["check-tp4-cp2-ep4"]
    assert res.returncode == 0, res.describe()
    n = CHECK_PROMPTS // 3
    assert f"[check] batch 1/{n}: prompts 3/{CHECK_PROMPTS}" in res.stderr, res.describe()
    assert f"[check] batch {n}/{n}: prompts {CHECK_PROMPTS}/{CHECK_PROMPTS}" in res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("prompt ")]
    assert [ln.split(" (")[0] for ln in lines] == [f"prompt {i}" for i in range(CHECK_PROMPTS)]
    assert all("smallest top-k routing margin" in ln and "in 3 steps" in ln for ln in lines)
    steps = 3 * CHECK_PROMPTS
    assert "decode: 3 steps per prompt" in res.stdout and f"top-1 matches {steps}/{steps}" \
        in res.stdout, res.describe()
    assert "routing near-ties (margin <=" in res.stdout


def test_check_measures_fp8_kv_against_a_16_bit_reference(multi):
    """`--reference-kv-cache-dtype auto` with `--kv-cache-dtype fp8_e4m3`: the reference runs
    over 16-bit pools, so the logits differ by the FP8 rounding (not by 1e-5 as a layout
    check's), and the run reports first-token agreement and exits 0."""
    res = multi["check-fp8-kv-vs-auto"]
    assert res.returncode == 0, res.describe()
    assert "kv cache dtype: layout fp8_e4m3, reference auto" in res.stdout
    agree = re.search(r"first-token agreement with the auto reference: (\d+)/3", res.stdout)
    assert agree, res.describe()
    diff = float(re.search(r"max \|logit diff\|: (\S+)", res.stdout)[1])
    assert diff > 1e-4, res.describe()  # the pools round: not the reference's own dtype


def test_v4_check_reports_indexer_margins_per_prompt(multi):
    """DeepSeek-V4's check also measures the lightning indexer's top-k margins on the
    reference: per prompt (inf where no query sees more entries than its top-k: 17 and 64
    tokens), a finite one for the 200-token prompts, and a summary line."""
    res = multi["check-v4-tp2-cp2-ep2"]
    assert res.returncode == 0, res.describe()
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("prompt ")]
    margins = [re.search(r"smallest indexer top-k margin (\S+) at layer", ln) for ln in lines]
    assert all(margins), res.describe()
    by_length = {int(re.search(r"\((\d+) tokens\)", ln)[1]): float(m[1])
                 for ln, m in zip(lines, margins)}
    assert by_length[17] == by_length[64] == float("inf"), by_length
    assert 0 < by_length[200] < float("inf"), by_length
    assert "indexer near-ties (margin <=" in res.stdout
    assert "indexer near-ties" in res.stderr  # the progress lines


# The whole sweep took 476 s on 2 busy cores (attention grows with the square of the length);
# 4K and 8K took 62 CPU-s. The default run checks a 2K and a 4K prompt: still one batch of two
# long prompts, the 4K one over two 1,024-query attention chunks on each CP rank (four on one
# rank), for about a third of the 4K + 8K cost; CPMOE_FULL=1 runs the 4K-16K sweep.
@pytest.mark.parametrize("lengths", ["2048,4096",
                                     pytest.param("4096,8192,12288,16384", marks=FULL)])
def test_check_long_prompts_4k_to_16k(cli, qwen2_moe_dir, request, lengths):
    n = len(lengths.split(","))
    res = cli("check", "--model", qwen2_moe_dir, *TP2_CP2_EP2, "--prompts", str(n),
              "--lengths", lengths, timeout=SWEEP_TIMEOUT_S)
    report(request, f"check of {lengths} tokens (qwen2_moe, tp2 cp2 ep2, {n} prompts): "
                    f"{res.elapsed_s:.1f} s, exit {res.returncode}")
    assert res.returncode == 0, res.describe()
    matches, prompts, diff, layout = parse_check(res)
    assert (matches, prompts) == (n, n), res.describe()
    assert diff <= 1e-5, res.describe()
    assert (layout["attn_cp_size"], layout["moe_ep_size"]) == (2, 2)


# ---- fault injection -------------------------------------------------------------------------

def test_injected_fault_fails_fast_and_leaves_no_rank(cli, workdir, ids_file, qwen3_moe_dir):
    out = workdir / "fault.safetensors"
    res = cli("prefill", "--model", qwen3_moe_dir, *TP4_CP2_EP4, "--input-ids-file", ids_file,
              "--dump-logits", out, env={"CPMOE_E2E_FAULT": "1:1"}, timeout=120)
    ranks_left = marked_ranks(res.marker)
    assert res.returncode == 1, res.describe()
    assert res.elapsed_s < 30, f"took {res.elapsed_s:.1f} s\n{res.describe()}"
    first = shown_lines(res.stderr)[0]
    assert first.startswith("cpmoe: rank 1 failed:"), res.describe()
    assert "injected fault at layer 1" in first, res.describe()
    assert "Traceback (most recent call last):" in res.stderr
    assert "RuntimeError: injected fault at layer 1" in res.stderr
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
    assert res.stdout == ""
    # the ranks did run (4 spawned), and none of them outlived the CLI
    assert res.ranks_spawned() == 4, res.interpreters()
    assert ranks_left == [], ranks_left
    deadline = time.monotonic() + 10  # helpers (multiprocessing's resource tracker) get a grace
    while marked_processes(res.marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(res.marker) == []
