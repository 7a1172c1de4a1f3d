"""What a new user meets first, run through the real CLI (`python -m cpmoe.cli`, CPU):
the context length is enforced before any work, and bad input gives one line and exit 2 at
every world size -- a rank's user error (a broken checkpoint) surfaces exactly as on one
rank, with no traceback.

Checkpoints here are the conftest's tiny Qwen3-MoE (vocab 256, no tokenizer), broken in one
way each. Calls run two at a time (each tp 2 call starts two ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests._full import full_matrix, full_run
from tests.e2e._serve_helpers import (REPO_ROOT, marked_processes, marked_ranks,
                                      pool_processes)
from tests.e2e.test_cli import Cli, CliResult, shown_lines

TP2 = ("--tp-size", "2", "--attn-cp-size", "2", "--ep-size", "2")
IDS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("first-use")


@pytest.fixture(scope="module")
def cli(workdir) -> Cli:
    return Cli(workdir, workdir / "cache")


@pytest.fixture(scope="module")
def ids_file(workdir) -> Path:
    path = workdir / "ids.json"
    path.write_text(json.dumps(IDS))
    return path


def assert_one_line(res: CliResult, *named: str) -> str:
    """Exit 2, exactly one `cpmoe: error:` line (as a terminal shows stderr) naming each of
    `named`, no traceback, nothing on stdout -> the line."""
    lines = shown_lines(res.stderr)
    assert res.returncode == 2, res.describe()
    assert len(lines) == 1 and lines[0].startswith("cpmoe: error: "), res.describe()
    assert "Traceback" not in res.stderr and res.stdout == "", res.describe()
    for text in named:
        assert text in lines[0], f"{text!r} not named\n{res.describe()}"
    return lines[0]


# ---- context length -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_model(make_hf_checkpoint) -> Path:
    return make_hf_checkpoint("qwen3_moe", max_position_embeddings=512)[1]


@pytest.fixture(scope="module")
def context_runs(cli, workdir, short_model) -> dict[str, CliResult]:
    long_ids = ",".join(["5"] * 594)
    long_file = workdir / "long.json"
    long_file.write_text(json.dumps([[5] * 600]))
    out = workdir / "long.safetensors"
    calls = {
        "generate-594-on-512": ("generate", "--model", short_model, "--input-ids", long_ids),
        "generate-flag-lowers": ("generate", "--model", short_model, "--input-ids", "1,2,3,4",
                                 "--max-new-tokens", "8", "--context-length", "10"),
        "generate-flag-too-long": ("generate", "--model", short_model, "--input-ids", "1,2",
                                   "--context-length", "1024"),
        "prefill-600-on-512": ("prefill", "--model", short_model, "--input-ids-file", long_file,
                               "--dump-logits", out),
        "check-lengths-on-512": ("check", "--model", short_model, "--lengths", "17,600"),
    }
    # all refused before any rank: cpmoe.cli.main in this process (no interpreter and torch
    # import per call), where starting a process fails the call (test_cli.Cli.in_process)
    return {k: cli.in_process(*v) for k, v in calls.items()}


def test_generate_refuses_prompt_plus_new_tokens_beyond_the_models_positions(context_runs):
    line = assert_one_line(context_runs["generate-594-on-512"])
    assert line == ("cpmoe: error: prompt of 594 tokens + --max-new-tokens 32 = 626 tokens "
                    "exceeds the context length of 512 tokens")
    assert context_runs["generate-594-on-512"].ranks_spawned() == 0


def test_context_length_flag_lowers_the_limit_and_cannot_raise_it(context_runs):
    assert_one_line(context_runs["generate-flag-lowers"], "4 tokens + --max-new-tokens 8 = 12",
                    "context length of 10 tokens")
    assert_one_line(context_runs["generate-flag-too-long"], "--context-length 1024",
                    "model's 512 positions")


def test_prefill_and_check_refuse_prompts_beyond_the_context_length(context_runs, workdir):
    assert_one_line(context_runs["prefill-600-on-512"], "prompt of 600 tokens",
                    "context length of 512 tokens")
    assert not (workdir / "long.safetensors").exists()
    assert_one_line(context_runs["check-lengths-on-512"], "--lengths 17,600", "512")


# ---- a broken checkpoint at tp 2: the tp 1 line, exit 2 ----------------------------------------

def _rewrite(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _truncate(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return dst


def _sharded_without_one_shard(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(dst / file))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    (dst / "model-00002-of-00002.safetensors").unlink()
    return dst


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
BROKEN = {
    "truncated-file": (_truncate, "unreadable safetensors file"),
    "missing-tensor": (lambda s, d: _rewrite(s, d, lambda t: t.pop(Q_PROJ)), Q_PROJ),
    "extra-tensor": (lambda s, d: _rewrite(s, d, lambda t: t.update(
        {"model.layers.0.self_attn.bogus.weight": t[Q_PROJ].clone()})), "bogus"),
    "misshaped-tensor": (lambda s, d: _rewrite(s, d, lambda t: t.update(
        {Q_PROJ: t[Q_PROJ][:-1].clone()})), Q_PROJ),
    "deleted-shard": (_sharded_without_one_shard, "model-00002-of-00002.safetensors"),
}


# The default run (2-core budget) keeps one break of each kind: a file unreadable, a tensor
# missing (the completeness proof), a shard missing; CPMOE_FULL=1 adds the other two.
BROKEN_DEFAULT = ("truncated-file", "missing-tensor", "deleted-shard")


@pytest.fixture(scope="module")
def broken_runs(request, cli, workdir, ids_file, qwen3_moe_dir
                ) -> dict[tuple[str, int], CliResult]:
    """(case, tp) -> the prefill run on that broken checkpoint, at tp 1 and tp 2. The tp 1
    run loads the checkpoint in the CLI's own process, so it is cpmoe.cli.main in this one
    (Cli.in_process: no interpreter and torch import; a process start fails the call); the
    tp 2 run is the real command, whose ranks find the break."""
    calls = {}
    for case, (make, _) in BROKEN.items():
        if case not in BROKEN_DEFAULT and not full_run(request.config):
            continue
        model = make(qwen3_moe_dir, workdir / case)
        for tp, flags in ((1, ()), (2, TP2)):
            calls[(case, tp)] = ("prefill", "--model", model, *flags, "--input-ids-file",
                                 ids_file, "--dump-logits", workdir / f"{case}-{tp}.out")
    here = {k: cli.in_process(*v) for k, v in calls.items() if k[1] == 1}
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(cli, *v) for k, v in calls.items() if k[1] != 1}
        return {**here, **{k: f.result() for k, f in futures.items()}}


@pytest.mark.parametrize("case", full_matrix(list(BROKEN), lambda c: c in BROKEN_DEFAULT))
def test_broken_checkpoint_at_tp2_is_the_tp1_line_and_exit_2(broken_runs, workdir, case):
    named = BROKEN[case][1]
    one = assert_one_line(broken_runs[(case, 1)], named)
    two = assert_one_line(broken_runs[(case, 2)], named)
    assert two == one
    assert broken_runs[(case, 2)].ranks_spawned() == 2
    assert "leaked" not in broken_runs[(case, 2)].stderr
    assert not (workdir / f"{case}-2.out").exists()


# ---- other user errors at tp 2: the tp 1 line, exit 2, no rank started ---------------------

@pytest.fixture(scope="module")
def input_runs(cli, workdir, ids_file, qwen3_moe_dir) -> dict[tuple[str, int], CliResult]:
    bad_config = workdir / "yarn-config"
    shutil.copytree(qwen3_moe_dir, bad_config)
    raw = json.loads((bad_config / "config.json").read_text())
    del raw["num_attention_heads"]
    (bad_config / "config.json").write_text(json.dumps(raw))
    bad_ids = workdir / "bad-ids.json"
    bad_ids.write_text(json.dumps([[1, 2, 256]]))
    cases = {
        "config": ("prefill", "--model", bad_config, "--input-ids-file", ids_file,
                   "--dump-logits", workdir / "x.out"),
        "input-ids": ("prefill", "--model", qwen3_moe_dir, "--input-ids-file", bad_ids,
                      "--dump-logits", workdir / "x.out"),
        "cache-size": ("generate", "--model", qwen3_moe_dir, "--input-ids", "1,2,3",
                       "--max-total-tokens", "16", "--max-new-tokens", "40"),
    }
    # refused before any rank: cpmoe.cli.main in this process (no interpreter and torch
    # import per call), where starting a process fails the call (test_cli.Cli.in_process)
    return {(case, tp): cli.in_process(*args, *flags) for case, args in cases.items()
            for tp, flags in ((1, ()), (2, TP2))}


@pytest.mark.parametrize("case,named", [("config", "missing field 'num_attention_heads'"),
                                        ("input-ids", "token id 256"),
                                        ("cache-size", "--max-total-tokens 16")])
def test_bad_input_at_tp2_is_one_line_before_any_rank(input_runs, case, named):
    one = assert_one_line(input_runs[(case, 1)], named)
    two = assert_one_line(input_runs[(case, 2)], named)
    if case != "cache-size":  # there the slots needed differ: CP shards a prompt's KV
        assert two == one
    assert input_runs[(case, 2)].ranks_spawned() == 0


# ---- under torchrun: one process per rank, started by the launcher ---------------------------

def _torchrun_world(cli: Cli, n: int, *args, env: dict[str, str] | None = None
                    ) -> list[CliResult]:
    """The CLI as torchrun starts it: n processes with RANK / WORLD_SIZE / MASTER_* set
    (rank 0 hosts the store on a free port) -> each rank's result, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def rank(r: int) -> CliResult:
        return cli(*args, env={**(env or {}), "RANK": str(r), "LOCAL_RANK": str(r),
                               "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(rank, range(n)))


def test_bad_input_under_torchrun_is_one_line_from_rank_0_only(cli, qwen3_moe_dir, ids_file,
                                                               workdir):
    ranks = _torchrun_world(cli, 2, "prefill", "--model", qwen3_moe_dir, "--tp-size", "4",
                            "--attn-cp-size", "2", "--input-ids-file", ids_file,
                            "--dump-logits", workdir / "tr.out")
    assert_one_line(ranks[0], "--tp-size 4", "WORLD_SIZE=2", "4 ranks")
    assert ranks[1].returncode == 2 and ranks[1].stderr == "" and ranks[1].stdout == "", \
        ranks[1].describe()


def test_a_failing_torchrun_rank_shows_its_error_and_its_peer_one_line(cli, qwen3_moe_dir):
    ranks = _torchrun_world(cli, 2, "generate", "--model", qwen3_moe_dir, "--tp-size", "2",
                            "--attn-cp-size", "2", "--input-ids", "1,2,3",
                            env={"CPMOE_E2E_FAULT": "1:1"})
    root, peer = ranks[1], ranks[0]
    assert root.returncode == 1, root.describe()
    assert shown_lines(root.stderr)[0].startswith("cpmoe: rank 1 failed: RuntimeError: "
                                                  "injected fault at layer 1"), root.describe()
    assert root.stderr.count("injected fault at layer 1") == 2  # the summary and its traceback
    assert peer.returncode == 1, peer.describe()
    lines = shown_lines(peer.stderr)
    assert len(lines) == 1, peer.describe()
    assert lines[0].startswith("cpmoe: rank 0 stopped: a peer rank left the job ("), lines
    assert lines[0].endswith("); the root error is in that rank's output"), lines


# ---- Ctrl-C --------------------------------------------------------------------------------

# ranks-starting: 0.2 s after the pool's first process appeared (on cpu the forkserver, still
# importing torch, before any rank exists; with 'spawn' a rank's interpreter still importing);
# ranks-running: 3 s after both ranks exist (loading the model, then generating).
@pytest.mark.parametrize("ranks,after_s", [(0, 0.2), (2, 3.0)],
                         ids=["ranks-starting", "ranks-running"])
def test_ctrl_c_stops_the_ranks_and_exits_130_without_a_traceback(cli, qwen3_moe_dir, ranks,
                                                                   after_s):
    marker = uuid.uuid4().hex
    env = {**os.environ, "CPMOE_CACHE_DIR": str(cli.cache_dir), "CPMOE_E2E_MARKER": marker,
           "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpmoe.cli", "generate", "--model", str(qwen3_moe_dir), *TP2,
         "--input-ids", "1,2,3", "--max-new-tokens", "20000", "--device", "cpu"],
        env=env, cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    try:
        deadline = time.monotonic() + 120
        while not pool_processes(marker) or len(marked_ranks(marker)) < ranks:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        time.sleep(after_s)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert err.decode() == "cpmoe: interrupted\n" and out == b""
    deadline = time.monotonic() + 10
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(marker) == []


# ---- first impressions ---------------------------------------------------------------------

def test_demo_generate_says_the_weights_are_random_and_prints_no_control_characters(cli):
    res = cli("generate", "--prompt", "Context parallel prefill", "--max-new-tokens", "16")
    assert res.returncode == 0, res.describe()
    assert res.stdout.endswith("\n") and res.stdout.count("\n") == 1, res.describe()
    text = res.stdout[:-1]
    assert all(c.isprintable() for c in text), repr(text)
    note = [line for line in shown_lines(res.stderr) if line.startswith("cpmoe: note:")]
    assert note == [("cpmoe: note: the built-in cpmoe-tiny-qwen3-moe has random weights, so "
                     "its tokens are noise; give --model DIR for a real checkpoint")], \
        res.describe()
    assert "loading weights" not in res.stderr  # no progress bar frozen at 0% in a log


def test_escape_text_keeps_newlines_and_escapes_control_characters():
    from cpmoe.cli.run import escape_text
    assert escape_text("a\nb\tc") == "a\nb\tc"
    assert escape_text("x\x1b[2Jy\x07\x7f") == "x\\x1b[2Jy\\x07\\x7f"
    assert escape_text("é€<|im_start|>") == "é€<|im_start|>"


def _flag_help(command: str) -> dict[str, str]:
    """flag -> its line(s) of `cpmoe COMMAND --help`, as argparse formats them."""
    from cpmoe.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices[command]
    formatter = p._get_formatter()
    return {a.option_strings[-1]: formatter._format_action(a) for a in p._actions
            if a.option_strings and a.dest != "help"}


@pytest.mark.parametrize("command,example", [("serve", ("--port", "(default: 8000)")),
                                             ("generate", ("--max-new-tokens", "(default: 32)"))])
def test_help_shows_every_flags_default(command, example):
    from cpmoe.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    defaults = {a.option_strings[-1]: a.default for a in sub.choices[command]._actions
                if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)}
    shown = _flag_help(command)
    assert defaults  # --port, --max-queue, --temperature, ...
    for flag, default in defaults.items():
        assert "default" in " ".join(shown[flag].split()), (flag, default, shown[flag])
    assert example[1] in shown[example[0]]


def test_generate_help_says_it_samples_with_a_temperature():
    from cpmoe.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert "greedy generation" not in helps["generate"]
    assert "sampled with --temperature > 0" in helps["generate"]


@pytest.fixture(scope="module")
def default_model_dir(cli) -> Path:
    from cpmoe.default_model import ensure_default_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPMOE_CACHE_DIR", str(cli.cache_dir))
        return ensure_default_model()


def test_serve_on_a_broken_checkpoint_at_tp2_is_one_line_and_exit_2(cli, workdir,
                                                                     default_model_dir):
    model = _truncate(default_model_dir, workdir / "serve-truncated")
    res = cli("serve", "--model", model, *TP2, "--port", "0")
    assert_one_line(res, "serve-truncated/model.safetensors", "unreadable safetensors file")
    assert res.ranks_spawned() == 2
