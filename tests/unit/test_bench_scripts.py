"""bench/h200_*.sh hide no failure: every step's output is saved, every step runs, and a
failing step (a test, a `cpmoe check`) fails the part and is named.

The scripts run for real under bash with a stand-in `python3` first on PATH that records its
arguments, prints a line, and fails when its command line contains $FAKE_FAIL; no GPU and
no torch are involved.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("h200_suite.sh", "h200_engine.sh")

FAKE_PYTHON = """#!/usr/bin/env bash
echo "${CPMOE_DECODE_KERNELS_CONFIG:+[tuned $CPMOE_DECODE_KERNELS_CONFIG] }$*" >> "$FAKE_LOG"
[ "${1:-}" = "-" ] && cat > /dev/null
echo "fake output of: $*"
# a server says where it serves on stderr, as `cpmoe serve` does
[[ "$*" == *"cpmoe.cli serve"* ]] && echo "cpmoe: serving fake at http://127.0.0.1:1 (fake)" >&2
if [ -n "${FAKE_FAIL:-}" ] && [[ "$*" == *"$FAKE_FAIL"* ]]; then
  echo "fake failure" >&2
  exit 3
fi
exit 0
"""


def _run(tmp_path: Path, script: str, part: str, fail: str = "", **more_env: str
         ) -> tuple[int, Path, list[str]]:
    bin_dir, out, log = tmp_path / "bin", tmp_path / "out", tmp_path / "calls.txt"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "FAKE_FAIL": fail, **more_env}
    proc = subprocess.run(["bash", str(REPO_ROOT / "bench" / script), part, str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc.returncode, out, calls


def _failed_lines(out: Path) -> list[str]:
    files = list(out.glob("failed-*.txt"))
    return [ln for f in files for ln in f.read_text().splitlines()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_do_not_swallow_exit_statuses(script):
    text = (REPO_ROOT / "bench" / script).read_text()
    assert "|| true" not in text and "set +e" not in text


def test_a_failing_check_fails_the_suite_and_the_later_checks_still_run(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_suite.sh", "peers", fail="alltoall_padded")
    assert rc == 1
    checks = [c for c in calls if "cpmoe.cli check" in c]
    assert len(checks) == 4 and "float32" in checks[-1]  # the ones after the failure ran
    failed = _failed_lines(out)
    assert len(failed) == 1 and failed[0].startswith("check-ep2-padded-bf16-")
    logs = {p.name.rsplit("-", 1)[0]: p.read_text() for p in out.glob("*.log")}
    assert {"check-ep2-bf16", "check-ep2-padded-bf16", "check-dp2-bf16", "check-ep2-fp32",
            "peers", "provenance-peers"} <= set(logs)
    bad = logs["check-ep2-padded-bf16"]
    assert "fake output of: -m cpmoe.cli check" in bad and "fake failure" in bad
    assert bad.rstrip().endswith("exit status 3")
    assert logs["check-ep2-fp32"].rstrip().endswith("exit status 0")
    assert any(c.startswith("-m cpmoe.bench.provenance") for c in calls)


def test_failing_gpu_tests_fail_the_profile_part_after_every_step_ran(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_suite.sh", "profile", fail="-m pytest tests/gpu")
    assert rc == 1 and [ln.split(":")[0].rsplit("-", 1)[0] for ln in _failed_lines(out)] == \
        ["gpu-tests"]
    assert any("cpmoe.cli check" in c for c in calls)
    assert sum("bench.phase_times" in c for c in calls) == 2


def test_a_part_whose_steps_pass_exits_0_and_lists_no_failure(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_suite.sh", "dispatch")
    assert rc == 0 and not _failed_lines(out)
    assert any("cpmoe.bench.dispatch" in c for c in calls)
    assert list(out.glob("provenance-dispatch-*.json"))


def test_engine_smoke_fails_on_failing_tests_and_still_takes_the_figures(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "smoke", fail="-m pytest tests/gpu")
    assert rc == 1 and _failed_lines(out)[0].startswith("gpu-tests:")
    assert any("bench-one-batch" in c for c in calls)
    assert "fake failure" in (out / "gpu-tests.log").read_text()
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "serving", fail="long-prompt-len")
    assert rc == 1 and _failed_lines(out)[0].startswith("serving-long-prompt:")
    assert sum("bench-serving" in c for c in calls) == 2


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unknown_part_is_refused(tmp_path, script):
    rc, _, calls = _run(tmp_path, script, "nonsense")
    assert rc == 2 and calls == []


def test_structured_part_runs_the_json_schema_load_and_the_same_load_without(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "structured")
    assert rc == 0, (out / "structured-compare.log").read_text()
    runs = [c for c in calls if "bench-serving" in c]
    assert len(runs) == 2 and "--json-schema" not in runs[0]
    schema = runs[1].split("--json-schema ")[1].split()[0]
    assert Path(schema).is_file() and runs[0].split("--out")[0] == runs[1].split("--json")[0]
    # both loads against the one server the part started, at the address it printed
    serve = [c for c in calls if "cpmoe.cli serve" in c]
    assert len(serve) == 1 and "--load-format dummy" in serve[0]
    assert all("--base-url http://127.0.0.1:1 " in r for r in runs)
    assert calls.index(serve[0]) < calls.index(runs[0])


@pytest.mark.parametrize("part, load, target", [
    ("fp8-serving", "--random-input-len 1024 --random-output-len 256", "1.3"),
    ("fp8-long", "--random-input-len 131072 --random-output-len 1 --num-prompts 2 "
                 "--max-concurrency 1", "1.45")])
def test_fp8_serving_parts_run_the_same_load_in_bf16_and_fp8_and_compare(tmp_path, part, load,
                                                                          target):
    rc, out, calls = _run(tmp_path, "h200_engine.sh", part)
    assert rc == 0, _failed_lines(out)
    runs = [c for c in calls if "bench-serving" in c]
    assert len(runs) == 2 and "--quantization" not in runs[0]
    assert runs[1].endswith("--quantization fp8 --kv-cache-dtype fp8_e4m3")
    assert load in runs[0]
    assert runs[0].split("--out")[0] == runs[1].split("--out")[0]  # the same load
    assert not any("long-prompt-len" in c for c in calls)  # not the serving part's runs
    assert any("bench.serving_ratio" in c and f"--min {target} " in c for c in calls)
    rc, out, _ = _run(tmp_path, "h200_engine.sh", part, fail=f"{part}-fp8.json")
    assert rc == 1 and _failed_lines(out)


def test_fp8_serving_takes_more_serve_flags_for_both_servers(tmp_path):
    """FP8_SERVE: the same extra flags for the bf16 and the FP8 server (on an 80 GB card,
    bf16's K/V capacity for both, so the ratio is of speed, not of memory)."""
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "fp8-serving",
                          FP8_SERVE="--max-total-tokens 90000 --page-size 32")
    assert rc == 0, _failed_lines(out)
    runs = [c for c in calls if "bench-serving" in c]
    assert len(runs) == 2
    assert all("--routing uniform --max-total-tokens 90000 --page-size 32" in c for c in runs)
    assert runs[1].endswith("--quantization fp8 --kv-cache-dtype fp8_e4m3")


def test_v4_serving_part_times_the_bound_serves_and_fails_over_it(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "v4-serving")
    assert rc == 0, _failed_lines(out)
    bound = next(c for c in calls if "bench.v4_serving bound" in c)
    load = next(c for c in calls if "bench-serving" in c)
    check = next(c for c in calls if "bench.v4_serving check" in c)
    assert "--prompt 65536 --chunk 8192 --streams 32" in bound
    assert "--num-prompts 32 --long-prompt-len 65536" in load
    assert "--load-format dummy" in load and "--chunked-prefill-size 8192" in load
    assert calls.index(bound) < calls.index(load) < calls.index(check)  # one GPU user a time
    rc, out, _ = _run(tmp_path, "h200_engine.sh", "v4-serving", fail="v4_serving check")
    assert rc == 1 and _failed_lines(out)[0].startswith("v4-serving-compare:")


def _v4_serving_files(tmp_path: Path, p99: float | None) -> list[str]:
    import json
    bound = {"chunk_mean_s": 0.5, "chunk_max_s": 0.7, "decode_median_s": 0.02}
    serving = {"summary": {"failed": 0, "long_prompt": {
        "prompt_len": 65536, "error": "", "step_s": 0.55,
        "itl_during_s": {"mean": None, "p50": None, "p90": None, "p99": p99}}}}
    (tmp_path / "b.json").write_text(json.dumps(bound))
    (tmp_path / "s.json").write_text(json.dumps(serving))
    return ["check", "--bound", str(tmp_path / "b.json"), "--serving", str(tmp_path / "s.json")]


@pytest.mark.parametrize("p99, rc", [(1.0, 0), (1.03, 0), (1.05, 1), (None, 1)])
def test_v4_serving_check_fails_past_twice_a_chunk_and_a_decode_step(tmp_path, capsys, p99, rc):
    from bench.v4_serving import main
    assert main(_v4_serving_files(tmp_path, p99)) == rc  # bound: 2 x (0.5 + 0.02) = 1.04 s
    assert len(capsys.readouterr().out.strip().splitlines()) == 1


def _summary(tok_s: float) -> dict:
    return {"summary": {"output_token_throughput": tok_s, "total_output_tokens": 1000,
                        "tpot_s": {"p50": 0.016}, "ttft_s": {"mean": 0.3}}}


@pytest.mark.parametrize("other, code", [(3000.0, 0), (2000.0, 1)])
def test_serving_ratio_passes_at_the_target_and_fails_under_it(tmp_path, capsys, other, code):
    import json

    from bench.serving_ratio import main
    base, run = tmp_path / "base.json", tmp_path / "other.json"
    base.write_text(json.dumps(_summary(3500.0)))
    run.write_text(json.dumps(_summary(other)))
    assert main([str(base), str(run), "--min", "0.8", "--names", "plain,json"]) == code
    out = capsys.readouterr().out
    assert f"plain 3500, json {other:.0f} ({other / 3500:.2f}x, target >= 0.8)" in out
    assert "KV slots" not in out  # no server metrics kept


def test_serving_ratio_shows_each_servers_kv_slots(tmp_path, capsys):
    """The servers' KV capacity beside the ratio (on 80 GB bf16 weights left K/V for 90 of
    128 requests, FP8's for all: a ratio of memory as much as of speed)."""
    import json

    from bench.serving_ratio import main
    base, run = tmp_path / "base.json", tmp_path / "other.json"
    for path, tok_s, slots in ((base, 2247.0, 94736.0), (run, 4302.0, 767376.0)):
        result = _summary(tok_s)
        result["server_metrics"] = {"cpmoe_kv_slots_capacity": slots,
                                    "cpmoe_requests_running": 0.0}
        path.write_text(json.dumps(result))
    assert main([str(base), str(run), "--min", "1.3", "--names", "bf16,fp8"]) == 0
    assert "KV slots a rank: 94736 / 767376" in capsys.readouterr().out


def test_serving_ratio_of_one_token_outputs_has_no_tpot(tmp_path, capsys):
    """fp8-long's loads give one output token a request: no TPOT (None), the TTFT ratio."""
    import json

    from bench.serving_ratio import main
    base, run = tmp_path / "base.json", tmp_path / "other.json"
    for path, tok_s, ttft in ((base, 0.096, 20.8), (run, 0.202, 9.9)):
        summary = _summary(tok_s)
        summary["summary"].update(tpot_s={"p50": None}, ttft_s={"mean": ttft})
        path.write_text(json.dumps(summary))
    assert main([str(base), str(run), "--min", "1.45", "--names", "bf16,fp8"]) == 0
    out = capsys.readouterr().out
    assert "TPOT p50 - / - ms; TTFT mean 20800.0 / 9900.0 ms (2.10x lower)" in out, out


SLOW_TO_STOP = """#!/usr/bin/env bash
# a step that takes a second to clean up after a TERM, as bench-serving stops its server
if [[ "$*" == *"$FAKE_SLOW"* ]]; then
  trap 'sleep 1; echo stopped > "$FAKE_DONE"; exit 143' TERM
  sleep 30 & wait
fi
exit 0
"""


def test_a_time_limit_stops_a_part_only_after_its_running_step_has_stopped(tmp_path):
    """`timeout` TERMs the part's whole process group; the part's shell exits once the step
    running then has finished stopping (its launched server gone), not at once."""
    bin_dir, done = tmp_path / "bin", tmp_path / "done"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(SLOW_TO_STOP)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "FAKE_SLOW": "cpmoe.bench.dispatch", "FAKE_DONE": str(done)}
    proc = subprocess.run(["timeout", "4", "bash", str(REPO_ROOT / "bench" / "h200_suite.sh"),
                           "dispatch", str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 124  # timed out
    assert done.exists(), "the part exited before its step had stopped"


def test_issue45_part_takes_the_four_figures_in_one_call_each_against_its_target(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "issue45")
    assert rc == 0, _failed_lines(out)
    decode = [c for c in calls if "bench-one-batch" in c]
    prefill = [c for c in calls if "cpmoe.cli bench " in c]
    serving = [c for c in calls if "bench-serving" in c]
    compares = [c for c in calls if "bench.speed_ratio" in c or "bench.serving_ratio" in c]
    assert len(decode) == 2 and len(prefill) == 4 and len(serving) == 2
    for pair in (decode, prefill[:2], prefill[2:], serving):  # bf16, then the same with FP8
        assert "--quantization" not in pair[0]
        assert "--quantization fp8 --kv-cache-dtype fp8_e4m3" in pair[1]
        assert pair[0].split("--out")[0] in pair[1]
    assert "--batch-size 64,128 --input-len 1024" in decode[0]
    assert "--lengths 16384 --iters 3" in prefill[0] and "--lengths 131072" in prefill[2]
    targets = [c.split("--min ")[1].split()[0] for c in compares]
    assert targets == ["1.6", "1.4", "1.45", "1.3"] and "--at 64" in compares[0]
    # one GPU user at a time: each pair's comparison after it, the served load last
    assert calls.index(compares[0]) < calls.index(prefill[0])
    assert calls.index(prefill[3]) < calls.index(serving[0])
    (tmp_path / "h100").mkdir()
    rc, out, calls = _run(tmp_path / "h100", "h200_engine.sh", "issue45",
                          ISSUE45_PREFILL="16384:3:1.4")  # an 80 GB card: no 128K pair
    assert rc == 0 and sum("cpmoe.cli bench " in c for c in calls) == 2
    assert not any("131072" in c for c in calls)
    # the part over two calls: the 128K pair alone, then the rest without it
    (tmp_path / "a").mkdir()
    rc, out, calls = _run(tmp_path / "a", "h200_engine.sh", "issue45", ISSUE45_DECODE="0",
                          ISSUE45_SERVE="0", ISSUE45_PREFILL="131072:2:1.45")
    steps = [c for c in calls if "cpmoe.bench.provenance" not in c]
    assert rc == 0 and len(steps) == 3 and all("131072" in c for c in steps)
    (tmp_path / "b").mkdir()
    rc, out, calls = _run(tmp_path / "b", "h200_engine.sh", "issue45", ISSUE45_PREFILL="none")
    assert rc == 0 and not any("cpmoe.cli bench " in c for c in calls)
    assert sum("bench-one-batch" in c for c in calls) == 2
    assert sum("bench-serving" in c for c in calls) == 2
    rc, out, _ = _run(tmp_path, "h200_engine.sh", "issue45", fail="issue45-prefill-16384-fp8")
    assert rc == 1 and [ln.split(":")[0] for ln in _failed_lines(out)] == [
        "issue45-prefill-16384-fp8", "issue45-prefill-16384-compare"]


def test_decode_tune_part_sweeps_picks_and_times_whole_steps_under_the_picked_tiles(tmp_path):
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "decode-tune")
    assert rc == 0, _failed_lines(out)
    kinds = ["bench.decode_attention", "bench.decode_kernels", "bench.fp8_linear",
             "bench.tuned_tiles", "bench-one-batch", "bench-one-batch", "bench-one-batch",
             "bench.speed_ratio"]
    steps = [c for c in calls if "cpmoe.bench.provenance" not in c]
    assert [next(k for k in kinds if k in c) for c in steps] == kinds
    tuned = f"[tuned {out}/tuned.json] "
    bf16, fp8, fp8_tuned = steps[4:7]
    assert "--quantization" not in bf16 and "--kv-cache-dtype fp8_e4m3" in fp8
    assert not fp8.startswith("[tuned") and fp8_tuned.startswith(tuned)  # only the third
    assert fp8_tuned[len(tuned):].split("--out")[0] == fp8.split("--out")[0]
    assert f"--out {out}/tuned.json" in steps[3]
    assert f"--skinny {out}/tune-skinny.json" in steps[3] and "--rows 1,64" in steps[2]
    rc, out, _ = _run(tmp_path, "h200_engine.sh", "decode-tune", fail="bench.decode_kernels")
    assert rc == 1 and [ln.split(":")[0] for ln in _failed_lines(out)] == ["tune-experts"]


def test_decode_ncu_part_profiles_one_eager_fp8_decode_step_and_prints_its_pages(tmp_path):
    fake_ncu = tmp_path / "bin" / "ncu"
    fake_ncu.parent.mkdir(exist_ok=True)
    fake_ncu.write_text('#!/usr/bin/env bash\necho "ncu $*" >> "$FAKE_LOG"\n'
                        '[ -n "${FAKE_FAIL:-}" ] && [[ "$*" == *"$FAKE_FAIL"* ]] && exit 3\n'
                        'exit 0\n')
    fake_ncu.chmod(0o755)
    rc, out, calls = _run(tmp_path, "h200_engine.sh", "decode-ncu")
    assert rc == 0, _failed_lines(out)
    profile, details, *sources = [c for c in calls if c.startswith("ncu ")]
    assert "--clock-control none" in profile and f"-o {out}/ncu-decode " in profile
    assert "--profile-from-start off" in profile  # the timed steps only (cuda_profiler_range)
    run = profile.split(" env ", 1)[1]
    assert run.startswith("CPMOE_PDL=0 python3 -m cpmoe.cli bench-one-batch")
    for flag in ("--batch-size 64", "--disable-cuda-graph", "--kv-cache-dtype fp8_e4m3",
                 "--quantization fp8"):
        assert flag in run
    assert f"--import {out}/ncu-decode.ncu-rep --page details" in details
    assert [c.split("--kernel-name ")[1].split()[0] for c in sources] == [
        "_paged_decode_stage1", "_skinny_fp8_kernel", "_expert_gemm_kernel"]
    rc, out, _ = _run(tmp_path, "h200_engine.sh", "decode-ncu", fail="--page details")
    assert rc == 1 and [ln.split(":")[0] for ln in _failed_lines(out)] == ["ncu-details"]


def _sweep_row(**kw) -> dict:
    return {"BLOCK_N": 64, "BLOCK_K": 256, "TMA_W": True, "TILES": 1, "QUANT_OUT": False,
            "num_warps": 4, "num_stages": 3} | kw


def test_tuned_tiles_keeps_the_built_in_tiles_unless_a_sweep_beats_them(tmp_path, capsys):
    from bench.tuned_tiles import main
    experts = [
        _sweep_row(gemm="gate_up", default=True, us=100.0, TMA_W=False),
        _sweep_row(gemm="gate_up", us=99.0),  # 1% faster: under the margin, kept
        _sweep_row(gemm="gate_up", us=101.0, BLOCK_N=128, QUANT_OUT=True, num_stages=2),
        _sweep_row(gemm="down", default=True, us=57.0),
        _sweep_row(gemm="down", us=55.0, TILES=2),  # 3.5% faster: tuned
        {"gemm": "quantize_act", "rows": 64, "us": 3.0}]
    attention = [
        {"dtype": "fp8", "default": True, "splits": 2, "us": 32.0, "BLOCK_N": 64,
         "num_warps": 4, "num_stages": 2, "PAGE_IDS": 0},
        {"dtype": "fp8", "splits": 1, "us": 20.0, "BLOCK_N": 64, "num_warps": 4,
         "num_stages": 3, "PAGE_IDS": 64},  # another split count: not compared
        {"dtype": "fp8", "splits": 2, "us": 33.0, "BLOCK_N": 64, "num_warps": 2,
         "num_stages": 3, "PAGE_IDS": 64}]
    for name, rows in (("e.json", experts), ("a.json", attention)):
        (tmp_path / name).write_text(json.dumps({"header": {}, "results": rows}))
    args = [str(tmp_path / "e.json"), str(tmp_path / "a.json"), "--out",
            str(tmp_path / "t.json")]
    assert main(args) == 0
    # gate/up: 128-column QUANT_OUT at 101 - 3.0 (the launch it saves) = 98.0, 2% faster
    assert json.loads((tmp_path / "t.json").read_text()) == {
        "gate_up": _sweep_row(BLOCK_N=128, QUANT_OUT=True, num_stages=2),
        "down": _sweep_row(TILES=2)}
    out = capsys.readouterr().out
    assert "attention_fp8: built-in 32.0 us, best 33.0 us" in out and ": kept" in out
    assert main(args + ["--margin", "0.05"]) == 0  # nothing 5% faster: an empty file
    assert json.loads((tmp_path / "t.json").read_text()) == {}
    assert "no kernel tuned" in capsys.readouterr().out
    # rows that carry their shape (bench.decode_attention's since 2026-12-07): every split
    # count the rule can give is a choice, at the sweep's fewest rows
    shape = {"rows": 64, "keys": 1056, "kv_heads": 4, "page": 16, "sms": 132}
    tile = {"BLOCK_N": 64, "num_warps": 4, "PAGE_IDS": 64}
    attention = [
        {"dtype": "fp8", **shape, "default": True, "splits": 2, "us": 32.0, "BLOCK_N": 64,
         "num_warps": 4, "num_stages": 2, "PAGE_IDS": 0},
        {"dtype": "fp8", **shape, "splits": 4, "us": 24.0, **tile, "num_stages": 4},
        {"dtype": "fp8", **shape, "splits": 2, "us": 26.0, **tile, "num_stages": 3},
        {"dtype": "fp8", **shape, "splits": 8, "us": 20.0, **tile, "num_stages": 5,
         "keys": 100}]  # 7 pages: the rule never gives 8 splits (128 keys a split at least)
    # 128 rows: the built-in rule gives 1 split, 8 programs an SM give 2
    at_128 = [
        {"dtype": "fp8", **shape, "rows": 128, "default": True, "splits": 1, "us": 50.0,
         "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "PAGE_IDS": 0},
        {"dtype": "fp8", **shape, "rows": 128, "splits": 2, "us": 50.5, **tile,
         "num_stages": 4},
        {"dtype": "fp8", **shape, "rows": 128, "splits": 1, "us": 49.0, **tile,
         "num_stages": 3},
        {"dtype": "fp8", **shape, "rows": 128, "splits": 1, "us": 10.0, **tile,
         "num_stages": 4}]  # at a count its PROGRAMS_PER_SM does not give there: not its
    (tmp_path / "a.json").write_text(json.dumps({"header": {}, "results": attention + at_128}))
    assert main(args) == 0
    # 4 splits at 64 rows x 4 KV heads on 132 SMs: 8 programs an SM (7 give 3)
    assert json.loads((tmp_path / "t.json").read_text())["attention_fp8"] == dict(
        tile, num_stages=4, PROGRAMS_PER_SM=8)
    # the same tile 20% slower than the built-in one at 128 rows: not a choice
    at_128[1]["us"] = 60.0
    (tmp_path / "a.json").write_text(json.dumps({"header": {}, "results": attention + at_128}))
    assert main(args) == 0  # the built-in split count: no PROGRAMS_PER_SM
    assert json.loads((tmp_path / "t.json").read_text())["attention_fp8"] == dict(
        tile, num_stages=3)
    # a tile not timed at 128 rows is not a choice either: nothing left to beat 32.0 us
    (tmp_path / "a.json").write_text(json.dumps({"header": {}, "results": attention + [
        r for r in at_128 if r["splits"] != 1 or r.get("default")]}))
    assert main(args) == 0
    assert "attention_fp8" not in json.loads((tmp_path / "t.json").read_text())


def _skinny(rows: int, shape: str, us: float, bn: int = 64, split: int | None = None,
            stages: int = 3, default: bool = False) -> dict:
    """A bench.fp8_linear result row at Qwen3-30B-A3B's q/k/v or o_proj shape."""
    n, k = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}[shape]
    split = split or {"qkv": 2 if rows > 32 else 4, "o_proj": 4}[shape]
    return {"shape": shape, "N": n, "K": k, "rows": rows, "us": us, "BLOCK_N": bn,
            "SPLIT_K": split, "num_warps": 4, "num_stages": stages,
            "path": "skinny default" if default else "skinny"}


def test_tuned_tiles_picks_skinny_tiles_by_both_projections_at_the_rules_split(tmp_path,
                                                                                capsys):
    from bench.tuned_tiles import main
    from cpmoe.ops.fp8_gemm import skinny_split
    # the rows' splits are the rule's: q/k/v at 64 rows in 2 K ranges, o_proj in 4
    assert (skinny_split(64, 5120, 2048), skinny_split(64, 2048, 4096)) == (2, 4)
    assert skinny_split(1, 5120, 2048) == 4
    rows = [_skinny(64, "qkv", 11.0, default=True), _skinny(64, "o_proj", 11.0, default=True),
            _skinny(1, "qkv", 6.0, default=True), _skinny(1, "o_proj", 6.0, default=True),
            # 32 columns: 20.0 against 22.0 at 64 rows, and as fast at 1 row: tuned
            _skinny(64, "qkv", 10.0, bn=32), _skinny(64, "o_proj", 10.0, bn=32),
            _skinny(1, "qkv", 6.0, bn=32), _skinny(1, "o_proj", 6.05, bn=32),
            # faster still at 64 rows, but only at a split the rule does not give q/k/v
            _skinny(64, "qkv", 8.0, bn=32, split=4, stages=4),
            _skinny(64, "o_proj", 9.0, bn=32, stages=4),
            _skinny(1, "qkv", 6.0, bn=32, stages=4), _skinny(1, "o_proj", 6.0, bn=32, stages=4),
            # the fastest at 64 rows (19.0), 17% slower at 1 row: not a choice
            _skinny(64, "qkv", 9.5, bn=128), _skinny(64, "o_proj", 9.5, bn=128),
            _skinny(1, "qkv", 7.0, bn=128), _skinny(1, "o_proj", 7.0, bn=128),
            # one shape only: not a choice
            _skinny(64, "qkv", 5.0, stages=5),
            {"shape": "qkv", "N": 5120, "K": 2048, "rows": 64, "hbm_floor_us": 2.2}]
    (tmp_path / "s.json").write_text(json.dumps({"header": {}, "complete": True,
                                                 "results": rows}))
    args = [str(tmp_path / "none-e.json"), str(tmp_path / "none-a.json"), "--skinny",
            str(tmp_path / "s.json"), "--out", str(tmp_path / "t.json")]
    assert main(args) == 0
    assert json.loads((tmp_path / "t.json").read_text()) == {
        "skinny": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3}}
    assert "skinny: built-in 22.0 us, best 20.0 us" in capsys.readouterr().out
    assert main(args + ["--margin", "0.1"]) == 0  # 9% faster: kept
    assert json.loads((tmp_path / "t.json").read_text()) == {}
    # a sweep cut off by its time limit (o_proj at 64 rows never timed): not a choice
    (tmp_path / "s.json").write_text(json.dumps({"header": {}, "complete": False, "results": [
        r for r in rows if (r.get("shape"), r.get("rows")) != ("o_proj", 64)]}))
    capsys.readouterr()
    assert main(args) == 0
    assert json.loads((tmp_path / "t.json").read_text()) == {}
    assert "the sweep did not finish" in capsys.readouterr().out


def _write(path: Path, rows: list[dict]) -> str:
    import json
    path.write_text(json.dumps({"header": {}, "rows": rows}))
    return str(path)


def test_speed_ratio_holds_the_named_rows_to_the_target(tmp_path, capsys):
    from bench.speed_ratio import main
    bf16 = _write(tmp_path / "a.json", [{"engine": "cpmoe", "batch": 64, "decode_ms": 17.2},
                                        {"engine": "cpmoe", "batch": 128, "decode_ms": 19.4},
                                        {"engine": "hf", "batch": 64, "decode_ms": 99.0}])
    fp8 = _write(tmp_path / "b.json", [{"engine": "cpmoe", "batch": 64, "decode_ms": 10.0},
                                       {"engine": "cpmoe", "batch": 128, "decode_ms": 13.9}])
    assert main([bf16, fp8, "--min", "1.6", "--at", "64"]) == 0  # 1.72x; 128's 1.40x unheld
    out = capsys.readouterr().out
    assert "batch 64: base 17.2 ms a step, other 10 ms a step: 1.720x, target >= 1.6" in out
    assert "batch 128" in out and "1.396x\n" in out
    assert main([bf16, fp8, "--min", "1.6"]) == 1  # every common row held: 128 misses
    assert main([bf16, fp8, "--min", "1.6", "--at", "64,256"]) == 1  # a held row missing
    prefill_a = _write(tmp_path / "c.json", [{"tokens": 16384, "seconds": 0.369}])
    prefill_b = _write(tmp_path / "d.json", [{"tokens": 16384, "seconds": 0.265}])
    assert main([prefill_a, prefill_b, "--min", "1.4"]) == 1  # 1.392x: short of 1.4
    assert "length 16384: base 0.369 s, other 0.265 s: 1.392x" in capsys.readouterr().out
    assert main([prefill_a, prefill_b, "--min", "1.39", "--at", "16384"]) == 0
    with pytest.raises(SystemExit, match="holds decode rows, .* prefill rows"):
        main([bf16, prefill_b, "--min", "1.4"])
    two_inputs = _write(tmp_path / "e.json", [  # --input-len 1024,4096: two rows a batch
        {"engine": "cpmoe", "batch": 64, "input_len": n, "decode_ms": 12.0} for n in (1024, 4096)])
    with pytest.raises(SystemExit, match="2 rows for 1 batch values"):
        main([bf16, two_inputs, "--min", "1.6"])
