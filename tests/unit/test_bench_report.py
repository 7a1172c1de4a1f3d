"""MFU and provenance of benchmark results, without running a benchmark.

References are written out here (the datasheet's 989 TFLOP/s, git run by hand in a scratch
repository), never taken from the code under test.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cpmoe.bench import provenance as pv
from cpmoe.bench import report as rp

REPO_ROOT = Path(__file__).resolve().parents[2]


def _row(seconds: float, flops: float, world: int, quantization: str | None = None) -> dict:
    res = {"seconds_per_rank": [seconds] * world, "seconds_iters_rank0": [seconds],
           "peak_bytes_per_rank": [-1] * world}
    base = {"engine": "cpmoe", "layout": "tp=1", "world_size": world, "length": 4096,
            "batch": 1, "tokens": 4096, "quantization": quantization}
    return rp.measured_row(base, res, flops, world)


def test_mfu_divides_by_the_datasheet_peak_and_reports_the_ceiling_beside_it():
    row = _row(seconds=0.5, flops=1e15, world=2)
    assert row["mfu"] == pytest.approx(1e15 / 0.5 / (989e12 * 2))  # H200 SXM datasheet
    assert row["mfu_vs_measured"] == pytest.approx(1e15 / 0.5 / (790e12 * 2))
    assert rp.error_row({"layout": "x"}, "boom")["mfu_vs_measured"] is None


def test_every_table_names_its_mfu_denominator():
    table = rp.markdown_table([_row(0.5, 1e15, 1)])
    head, _, first = table.splitlines()
    assert "MFU vs 989 TF/s peak" in head and "MFU vs 790 TF/s measured" in head
    cells = [c.strip() for c in first.split("|")]
    assert "202.2%" in cells and "253.2%" in cells  # 2e15 FLOP/s over 989e12 and 790e12


def test_fp8_rows_take_the_fp8_datasheet_peak_and_no_bf16_columns():
    """--quantization fp8: MFU over the H200's 1,979 TFLOP/s dense FP8 datasheet peak; the
    bf16 columns empty (an FP8 16K / 64K prefill had read 76% / 100% of the measured bf16
    ceiling on an H100 at 399e67c). A table with an FP8 row names the FP8 denominator."""
    row = _row(seconds=0.5, flops=1e15, world=2, quantization="fp8")
    assert row["mfu_fp8"] == pytest.approx(1e15 / 0.5 / (1979e12 * 2))
    assert row["mfu"] is None and row["mfu_vs_measured"] is None
    table = rp.markdown_table([_row(0.5, 1e15, 1), _row(0.5, 1e15, 1, "fp8")])
    head, _, bf16, fp8 = ([c.strip() for c in line.split("|")] for line in table.splitlines())
    peak, measured = head.index("MFU vs 989 TF/s peak"), head.index("MFU vs 790 TF/s measured")
    col = head.index("MFU vs 1979 TF/s FP8 peak")
    assert fp8[col] == "101.1%" and fp8[peak] == fp8[measured] == "-"  # 2e15 / 1979e12
    assert bf16[col] == "-" and bf16[peak] == "202.2%"
    assert "FP8 peak" not in rp.markdown_table([_row(0.5, 1e15, 1)])


def test_an_fp8_file_is_rerendered_against_the_fp8_peak():
    """A file written before the FP8 column: its header's --quantization fp8 applies to the
    cpmoe rows (HF's run in bf16)."""
    path = REPO_ROOT / "bench/results/fp8-prefill-fp8attn-399e67c.json"
    result = json.loads(path.read_text())
    assert result["header"]["quantization"] == "fp8"
    rows = result["rows"]
    rp.recompute_mfu(rows, "fp8")
    row = next(r for r in rows if r["length"] == 16384)
    flops = 2 * 16384 * 2_730_702_848 + 2 * 48 * 32 * 128 * 16384**2
    assert row["mfu"] is None and row["mfu_fp8"] == pytest.approx(
        flops / row["seconds"] / 1979e12)
    hf = {"engine": "hf", "model_flops": flops, "seconds": 1.0, "world_size": 1}
    rp.recompute_mfu([hf], "fp8")
    assert hf["mfu"] == pytest.approx(flops / 989e12) and "mfu_fp8" not in hf


def test_old_result_files_are_rerendered_against_the_datasheet_peak():
    """The checked-in 1-GPU file holds MFU vs the measured ceiling in "mfu"; the 4K row:
    2*4096*2,730,702,848 + 2*48*32*128*4096^2 FLOPs in its recorded seconds."""
    path = REPO_ROOT / "bench/results/qwen3-30b-a3b-1gpu-20261130.json"
    rows = json.loads(path.read_text())["rows"]
    row = rows[0]
    assert row["length"] == 4096 and row["mfu"] == pytest.approx(0.485, abs=5e-4)
    flops = 2 * 4096 * 2_730_702_848 + 2 * 48 * 32 * 128 * 4096**2
    rp.recompute_mfu(rows)
    assert row["mfu"] == pytest.approx(flops / row["seconds"] / 989e12)
    assert row["mfu"] == pytest.approx(0.388, abs=5e-4)
    assert row["mfu_vs_measured"] == pytest.approx(0.485, abs=5e-4)


def test_the_near_tie_label_needs_the_gap_within_twice_the_logit_difference():
    base = {"layout": "x", "length": 1, "batch": 1, "top1_agrees_vs_tp1": False,
            "logits_max_abs_diff_vs_tp1": 0.05}
    tie = rp.markdown_table([{**base, "ref_top1_top2_gap": 0.09}])
    real = rp.markdown_table([{**base, "ref_top1_top2_gap": 0.11}])
    assert "no (near tie)" in tie and "**no**" in real and "near tie" not in real


# ---- provenance ------------------------------------------------------------------------

def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


@pytest.fixture()
def scratch_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "cpmoe").mkdir(parents=True)
    (root / "bench" / "results").mkdir(parents=True)
    (root / "cpmoe" / "a.py").write_text("x = 1\n")
    (root / "bench" / "run.sh").write_text("echo hi\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return root


def test_git_state_names_the_commit_and_what_makes_the_tree_dirty(scratch_repo: Path):
    root = scratch_repo
    head = _git(root, "rev-parse", "HEAD")
    assert pv.git_state(root, {}) == {"git_commit": head, "git_dirty": False,
                                      "git_source": "git"}
    # named explicitly, the environment wins (a copied tree may carry a stale .git)
    said = pv.git_state(root, {"CPMOE_GIT_COMMIT": "abc123", "CPMOE_GIT_DIRTY": "0"})
    assert (said["git_commit"], said["git_dirty"]) == ("abc123", False)
    (root / "bench" / "results" / "new.json").write_text("{}")  # a result being written
    assert pv.git_state(root)["git_dirty"] is False
    (root / "cpmoe" / "b.py").write_text("y = 2\n")  # untracked code
    assert pv.git_state(root)["git_dirty"] is True
    (root / "cpmoe" / "b.py").unlink()
    (root / "cpmoe" / "a.py").write_text("x = 2\n")  # a tracked file edited
    assert pv.git_state(root)["git_dirty"] is True


def test_git_state_outside_a_checkout_takes_the_environment_or_says_unknown(tmp_path: Path):
    env = {"CPMOE_GIT_COMMIT": "abc123", "CPMOE_GIT_DIRTY": "1"}
    got = pv.git_state(tmp_path, env)
    assert (got["git_commit"], got["git_dirty"]) == ("abc123", True)
    assert got["git_source"].startswith("environment")
    got = pv.git_state(tmp_path, {})
    assert got["git_commit"] is None and got["git_dirty"] is None
    assert got["git_source"].startswith("unknown")


def test_source_hash_changes_with_any_source_byte_and_ignores_other_files(scratch_repo: Path):
    root = scratch_repo
    first = pv.source_sha256(root)
    (root / "bench" / "results" / "r.json").write_text("{}")
    (root / "README.md").write_text("docs\n")
    assert pv.source_sha256(root) == first
    (root / "bench" / "run.sh").write_text("echo ho\n")
    assert pv.source_sha256(root) != first


def test_provenance_records_versions_device_and_the_exact_command():
    import importlib.metadata

    import torch
    argv = ["cpmoe", "bench", "--layouts", "tp=1;tp=2,cp=2"]
    got = pv.provenance(argv)
    assert got["command"] == "cpmoe bench --layouts 'tp=1;tp=2,cp=2'"  # shell-quoted
    assert got["torch"] == torch.__version__
    assert got["transformers"] == importlib.metadata.version("transformers")
    assert got["triton"] == importlib.metadata.version("triton")
    assert got["devices"] and all(isinstance(d, str) and d for d in got["devices"])
    assert got["git_commit"] == _git(REPO_ROOT, "rev-parse", "HEAD")
    assert isinstance(got["git_dirty"], bool)
    assert set(pv.PROVENANCE_KEYS) <= set(got)


def test_provenance_check_tells_this_trees_files_from_others(tmp_path: Path):
    ours, theirs, bare = tmp_path / "ours.json", tmp_path / "theirs.json", tmp_path / "b.json"
    head = pv.provenance(["cpmoe", "bench"])
    ours.write_text(json.dumps({"header": head, "rows": []}))
    theirs.write_text(json.dumps({"header": {**head, "source_sha256": "0" * 64}, "rows": []}))
    bare.write_text(json.dumps({"header": {"command": "x"}, "rows": []}))
    assert pv.main(["--check", str(ours)]) == 0
    assert pv.main(["--check", str(theirs)]) == 1
    ok, line = pv.check_file(bare)
    assert not ok and "no provenance" in line


def test_report_command_reprints_a_result_file_with_both_mfu_columns(capsys):
    path = REPO_ROOT / "bench/results/qwen3-30b-a3b-1gpu-20261130.json"
    assert rp.main([str(path)]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("| tp=1 | 4096 |"))
    assert "| 38.8% | 48.5% |" in row  # datasheet peak, then measured ceiling
    assert rp.main([]) == 2


def test_long_prompt_interference_splits_gaps_at_its_window_and_reports_a_failure():
    """Gaps that overlap the long prompt's [sent, done] window count as 'during'; the ratio
    is the p99 of those over 2 x (its TTFT / its chunks); a long prompt that failed gives
    no ratio and a line that says so, not a crash."""
    from cpmoe.bench.serving_report import Outcome, interference, long_line
    stream = Outcome(8, 8, ok=True, chunk_times=[0.0, 1.0, 5.0, 5.5, 9.0])
    long = {"prompt_len": 300, "sent": 2.0, "done": 5.2, "ttft_s": 3.0, "error": ""}
    got = interference([stream], long, 100)
    assert got["chunks"] == 3 and got["step_s"] == 1.0
    assert got["itl_during_s"]["p99"] == 4.0  # the 1.0 -> 5.0 and 5.0 -> 5.5 gaps
    assert got["itl_outside_s"]["p50"] in (1.0, 3.5)
    assert got["p99_itl_vs_2x_step"] == 2.0
    failed = interference([stream], {**long, "ttft_s": 0.0, "error": "HTTP 400"}, 100)
    assert failed["p99_itl_vs_2x_step"] is None and failed["step_s"] is None
    assert "FAILED: HTTP 400" in long_line(failed)


def test_ttft_breakdown_line_reports_the_parts_and_skips_a_run_without_successes():
    """The report's TTFT line gives the client's send delay beside the server's own TTFT and
    intake; a run where every request failed has no TTFT to break down (no crash)."""
    from cpmoe.bench.serving_report import Outcome, report, summarize
    ok = Outcome(8, 2, ok=True, tokens=2, ttft=0.5, sent=0.125, latency=0.75)
    s = {**summarize([ok], 1.0), "server_ttft_s": 0.25, "server_intake_s": 0.0625}
    assert ("TTFT mean 500.0 ms here: request on the wire after 125.0 ms; the server's own "
            "TTFT 250.0 ms, of it intake (body, parse, tokenize) 62.5 ms") in report(s)
    failed = {**summarize([Outcome(8, 2)], 1.0), "server_ttft_s": 0.25,
              "server_intake_s": 0.0625}
    assert "on the wire" not in report(failed)
