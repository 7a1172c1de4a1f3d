"""`cpmoe bench` and the bench/ scripts on CPU (gloo, tiny shapes): they run, write the JSON
they promise, and their correctness checks hold; bench and bench-one-batch take
`--quantization fp8`. No timing is asserted.

The command-line runs are subprocesses (an interpreter and a torch import each, plus the
ranks they spawn), so each is made once, all started together in the module fixture `runs`
(two at a time), and read by the tests; the refusals, which start nothing, are
`cpmoe.cli.main` calls in the test process.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cpmoe.bench.spec import (
    SHAPES,
    BenchError,
    active_params,
    model_flops,
    parse_config,
    parse_layout,
    parse_layouts,
    parse_lengths,
)
from cpmoe.parallel.layout import LayoutError
from tests.e2e.test_cli import Cli, CliResult

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a hang guard: a loaded 2-core machine took over 240 s for a --launch run
LAYOUTS = "tp=1;tp=2,cp=2,ep=2;tp=2,cp=2,ep=2,placement=balanced"


def _run(args: list[str], env: dict | None = None,
         cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={**os.environ, **(env or {})},
                          check=False)


def _bench_args(out: Path, *extra: str) -> list[str]:
    return ["-m", "cpmoe.cli", "bench", "--shape", "tiny", "--device", "cpu", "--iters", "1",
            "--warmup", "0", "--out", str(out), *extra]


BAD_LAYOUTS = ("tp=2,cp=3", "tp=2,bogus=1", "tp=1;tp=3")
V4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
    "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "sliding_window": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "hc_mult": 4,
    "compress_ratios": [128, 4, 0, 4], "num_hash_layers": 2, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
GSP_ARGS = ["--dataset", "shared-prefix", "--gsp-system-prompt-len", "32", "--gsp-question-len",
            "8", "--gsp-output-len", "3", "--num-prompts", "3", "--max-concurrency", "1",
            "--launch", "--device", "cpu"]
# bench-serving runs once, on the shared-prefix dataset (GSP_ARGS: a server started by
# --launch is three interpreters with a torch import); its random dataset differs only in
# the requests it draws, checked in this process (test_random_dataset_draws_...)
# bench-one-batch runs once, with --quantization fp8 (test_bench_one_batch_takes_...): the
# provenance test reads the same run
SERVING_ARGS = {
    "bench-one-batch": ["--shape", "tiny", "--batch-size", "2", "--input-len", "16",
                        "--output-len", "3", "--quantization", "fp8", "--device", "cpu"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command-line run of this module, started at once two at a time (each is an
    interpreter and a torch import, plus its ranks: run one after another they leave one of
    the 2 cores idle): name -> (future of the finished process, its folder)."""
    def folder(name: str) -> Path:
        return tmp_path_factory.mktemp(name.replace("=", "").replace(";", "_")
                                       .replace(",", "_"))

    calls: dict[str, tuple] = {}
    d = folder("bench")
    calls["bench"] = (_bench_args(d / "tiny.json", "--lengths", "64,128", "--layouts", LAYOUTS,
                                  "--compare-hf", "--plot"), None, REPO_ROOT, d)
    for layouts in BAD_LAYOUTS:
        d = folder("bad")
        calls[f"bad-{layouts}"] = (_bench_args(d / "bad.json", "--lengths", "64", "--layouts",
                                               layouts), None, REPO_ROOT, d)
    d = folder("big")
    calls["cannot-fit"] = (["-m", "cpmoe.cli", "bench", "--shape", "qwen3-30b-a3b", "--device",
                            "cpu", "--out", str(d / "big.json")], None, REPO_ROOT, d)
    # one tp=1 run for two tests (each run is a CLI and a rank): no --out (the file goes to
    # the cache folder) and an out-of-memory injected at length 64
    d = folder("no-out-oom")
    calls["no-out-oom"] = (["-m", "cpmoe.cli", "bench", "--shape", "tiny", "--device", "cpu",
                            "--iters", "1", "--warmup", "0", "--lengths", "32,64,96"],
                           {"CPMOE_CACHE_DIR": str(d / "cache"), "PYTHONPATH": str(REPO_ROOT),
                            "CPMOE_BENCH_INJECT_OOM": "64"}, d, d)
    for script in ("attention_cp", "dispatch"):
        d = folder(script)
        calls[script] = (["-m", f"cpmoe.bench.{script}", "--device", "cpu", "--smoke", "--out",
                          str(d / f"{script}.json")], None, REPO_ROOT, d)
    d = folder("v4")
    (d / "v4.json").write_text(json.dumps(V4_CONFIG))
    calls["v4"] = (["-m", "cpmoe.cli", "bench", "--config", str(d / "v4.json"), "--device",
                    "cpu", "--dtype", "float32", "--iters", "1", "--warmup", "0", "--lengths",
                    "300", "--layouts", "tp=1;tp=2,cp=2,ep=2,backend=alltoall_padded", "--out",
                    str(d / "v4-bench.json")], None, REPO_ROOT, d)
    for command, args in SERVING_ARGS.items():
        d = folder(command)
        calls[command] = (["-m", "cpmoe.cli", command, "--out", str(d / f"{command}.json"),
                           *args], None, REPO_ROOT, d)
    d = folder("fp8")
    calls["fp8"] = (_bench_args(d / "fp8.json", "--lengths", "64", "--layouts", "tp=1",
                                "--quantization", "fp8"), None, REPO_ROOT, d)
    d = folder("gsp")  # the same run profiles its first 4 engine steps
    calls["shared-prefix"] = (["-m", "cpmoe.cli", "bench-serving", "--out", str(d / "gsp.json"),
                               "--profile", "--profile-num-steps", "4", *GSP_ARGS],
                              {"CPMOE_TORCH_PROFILER_DIR": str(d / "profile")}, REPO_ROOT, d)
    # Refused before any rank: cpmoe.cli.main in this process (test_cli.Cli.in_process: no
    # interpreter and torch import each; starting a process fails the call), before the pool
    # starts (the refusal patches process starts process-wide).
    here = {}
    for name in [*(f"bad-{layouts}" for layouts in BAD_LAYOUTS), "cannot-fit"]:
        args, _, _, d = calls.pop(name)
        done: Future = Future()
        done.set_result(Cli(d, d / "cache").in_process(*args[2:]))
        here[name] = (done, d)
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {**here, **{name: (pool.submit(_run, args, env, cwd), d)
                          for name, (args, env, cwd, d) in calls.items()}}


def _result(runs, name: str) -> tuple[subprocess.CompletedProcess | CliResult, Path]:
    future, folder = runs[name]
    return future.result(), folder


@pytest.fixture(scope="module")
def bench_run(runs) -> tuple[subprocess.CompletedProcess, Path]:
    proc, d = _result(runs, "bench")
    return proc, d / "tiny.json"


@pytest.fixture(scope="module")
def bench_rows(bench_run) -> list[dict]:
    proc, out = bench_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


# ---- cpmoe bench ---------------------------------------------------------------------------

def test_bench_writes_a_row_per_layout_and_length(bench_run, bench_rows):
    proc, out = bench_run
    head = json.loads(out.read_text())["header"]
    assert head["active_params"] == active_params(parse_config(SHAPES["tiny"], "tiny"))
    assert head["torch"] == torch.__version__ and head["date"] and "bench" in head["command"]
    _assert_provenance(head)
    assert head["gpu"]  # the device rank 0 ran on
    assert head["peak_flops_per_gpu"] == 989e12 and head["measured_flops_per_gpu"] == 790e12
    got = [(r["engine"], r["layout"], r["length"]) for r in bench_rows]
    assert got == [("cpmoe", "tp=1", 64), ("cpmoe", "tp=1", 128),
                   ("cpmoe", "tp=2,cp=2,ep=2", 64), ("cpmoe", "tp=2,cp=2,ep=2", 128),
                   ("cpmoe", "tp=2,cp=2,ep=2,placement=balanced", 64),
                   ("cpmoe", "tp=2,cp=2,ep=2,placement=balanced", 128),
                   ("hf", "hf", 64), ("hf", "hf", 128)]
    for r in bench_rows:
        assert r["error"] is None
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["mfu"] > 0
        assert r["tokens"] == r["batch"] * r["length"] == r["length"]
        assert r["model_flops"] == model_flops(parse_config(SHAPES["tiny"], "tiny"),
                                               [r["length"]])
        assert r["peak_gib_per_rank"] is None  # nobody counts CPU memory
    for r in bench_rows[:6]:
        assert len(r["comm_s_per_rank"]) == r["world_size"] == r["sizes"]["world_size"]
        assert len(r["weights_gib_per_rank"]) == r["world_size"]
        assert r["speedup_vs_tp1"] > 0
    cp = bench_rows[2]
    assert cp["sizes"]["attn_cp_size"] == 2 and cp["sizes"]["moe_ep_size"] == 2
    assert all(c > 0 for c in cp["comm_s_per_rank"])  # the CP layout communicates
    assert bench_rows[0]["ratio_vs_hf"] > 0 and cp["ratio_vs_hf"] is None
    assert "| tp=2,cp=2,ep=2 | 64 | 1 |" in proc.stdout  # the markdown table


def _assert_provenance(head: dict) -> None:
    """The provenance every result file carries (values checked in test_bench_report)."""
    from cpmoe.bench.provenance import PROVENANCE_KEYS
    assert set(PROVENANCE_KEYS) <= set(head), set(PROVENANCE_KEYS) - set(head)
    assert head["git_commit"] and isinstance(head["git_dirty"], bool)
    assert len(head["source_sha256"]) == 64 and head["devices"]


def test_bench_layout_logits_match_the_one_rank_layout_at_every_length(bench_run, bench_rows):
    proc, _ = bench_run
    assert [r["check_note"] for r in bench_rows[:2]] == ["reference of the logit check"] * 2
    # every other layout and HF (same random weights, float32 on CPU), at both lengths
    for r in bench_rows[2:]:
        assert r["logits_max_abs_diff_vs_tp1"] <= 1e-4 and r["top1_agrees_vs_tp1"], r
        assert r["ref_top1_top2_gap"] >= 0 and r["top1_top2_gap"] >= 0
    assert bench_rows[0]["top1_top2_gap"] >= 0  # the reference's own gap too
    assert "| hf | 128 | 1 |" in proc.stdout and "top-1/top-2 gap" in proc.stdout


def test_bench_balanced_placement_evens_the_ep_ranks_and_keeps_the_logits(bench_run,
                                                                            bench_rows):
    proc, _ = bench_run
    placed = bench_rows[4]
    balance = placed["expert_placement"]
    assert balance["calibration_tokens"] > 0
    assert (balance["busiest_rank_load_vs_mean_after"]
            < balance["busiest_rank_load_vs_mean_before"])
    assert placed["logits_max_abs_diff_vs_tp1"] <= 1e-4 and placed["top1_agrees_vs_tp1"]
    assert "expert_placement" not in bench_rows[2]
    assert "experts placed by a" in proc.stderr + proc.stdout


def test_bench_plots_or_warns(bench_run, bench_rows):
    proc, out = bench_run
    png = out.with_suffix(".png")
    assert png.exists() or "matplotlib is not installed" in proc.stderr


@pytest.mark.parametrize("layouts", BAD_LAYOUTS)
def test_bench_bad_layouts_exit_2_with_one_line(runs, layouts):
    proc, d = _result(runs, f"bad-{layouts}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpmoe: error: --layouts"), lines
    assert not (d / "bad.json").exists()


def test_bench_whose_weights_cannot_fit_is_one_line_before_any_rank(runs):
    """The 30B shape on CPU: its weights alone (61 GB in float32 at tp 1) exceed any test
    machine's memory; refused from the shapes on the meta device, nothing written."""
    proc, d = _result(runs, "cannot-fit")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "GB" in lines[0] and "qwen3-30b-a3b" in lines[0], lines
    assert not (d / "big.json").exists()


def _no_out_file(d: Path) -> list[Path]:
    return list((d / "cache" / "bench").glob("tiny-*.json"))


def test_bench_without_out_writes_to_the_cache_folder_not_the_cwd(runs):
    proc, d = _result(runs, "no-out-oom")  # run in d, with its cache folder d / "cache"
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = _no_out_file(d)
    assert len(written) == 1 and json.loads(written[0].read_text())["rows"]
    assert not (d / "bench").exists()


def test_bench_out_of_memory_is_a_row_and_the_run_goes_on(runs):
    proc, d = _result(runs, "no-out-oom")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(_no_out_file(d)[0].read_text())["rows"]
    assert [r["error"] for r in rows] == [None, "out of memory", "out of memory"]
    assert "not run" in rows[2]["error_detail"] and rows[0]["tokens_per_s"] > 0


# ---- pure parts ----------------------------------------------------------------------------

def test_layout_strings_parse_to_validated_layouts():
    bl = parse_layout("tp=2, cp=2 ,dp=1,ep=2,backend=alltoall")
    assert bl.name == "tp=2,cp=2,ep=2,backend=alltoall"
    assert (bl.layout.tp_size, bl.layout.attn_cp_size, bl.layout.ep_size) == (2, 2, 2)
    assert parse_layout("tp=4,cp=2,strategy=interleave").name == "tp=4,cp=2,strategy=interleave"
    cfg = parse_config(SHAPES["qwen3-30b-a3b"], "qwen3")
    assert [b.name for b in parse_layouts("tp=1;tp=8,cp=8,ep=8", cfg)] == ["tp=1",
                                                                            "tp=8,cp=8,ep=8"]
    assert parse_layout("tp=2,cp=2,ep=2,placement=balanced").placement == "balanced"
    for bad in ("tp", "tp=1,tp=2", "cp=2", "tp=2,backend=nccl", "tp=1.5", "",
                "tp=2,ep=2,placement=eplb", "tp=2,cp=2,placement=balanced"):
        with pytest.raises(LayoutError):
            parse_layouts(bad, cfg)
    with pytest.raises(LayoutError, match="num_attention_heads"):
        parse_layouts("tp=1;tp=3", cfg)  # model fit, checked before anything runs
    with pytest.raises(BenchError):
        parse_lengths("64,abc")
    assert parse_lengths("128,64,128") == [64, 128]


def test_active_params_count_the_hf_models_weights_one_token_meets():
    """Against transformers' own parameter list (meta device: no memory), with routed
    experts counted top_k / num_experts and embedding / lm_head left out."""
    from transformers import AutoModelForCausalLM

    from cpmoe.bench.hf_task import hf_config
    qwen2 = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
             "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1],
             "qkv_bias": True, "rope_theta": 10000.0, "tie_word_embeddings": False}
    # the 30B shape at 2 of its 48 layers (its widths and 128 experts, in a twentieth of the
    # modules to build); its full count is pinned below, and the other shapes check the
    # sum over layers against HF
    thin_30b = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 2}
    for raw in (thin_30b, SHAPES["tiny"], qwen2):
        cfg = parse_config(raw, "test")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(raw))
        want = sum(p.numel() * (cfg.num_experts_per_tok / cfg.num_experts
                                if ".experts." in n else 1)
                   for n, p in model.named_parameters()
                   if "embed_tokens" not in n and not n.startswith("lm_head"))
        assert active_params(cfg) == want
    assert active_params(parse_config(SHAPES["qwen3-30b-a3b"], "q")) == 2_730_702_848


def test_model_flops_add_causal_attention_per_sequence():
    cfg = parse_config(SHAPES["qwen3-30b-a3b"], "q")
    dense = 2 * 4096 * active_params(cfg)
    attn = 2 * 48 * 32 * 128 * 4096**2
    assert model_flops(cfg, [4096]) == dense + attn
    assert model_flops(cfg, [2048, 2048]) == dense + attn / 2


# ---- python3 -m cpmoe.bench.attention_cp / .dispatch ----------------------------------------

@pytest.mark.parametrize("script", ["attention_cp", "dispatch"])
def test_bench_script_smoke_writes_json(runs, script):
    proc, d = _result(runs, script)
    out = d / f"{script}.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    measured = [r for r in data["rows"] if r.get("error") is None]
    assert measured and data["header"]["device"] == "cpu"
    _assert_provenance(data["header"])
    assert f"-m cpmoe.bench.{script} --device cpu --smoke --out" in data["header"]["command"]
    if script == "attention_cp":
        for engine, base in (("cpmoe_cp", "sdpa_gqa"), ("cpmoe_cp_mha", "sdpa_mha")):
            cp = [r for r in measured if r["engine"] == engine]
            assert len(cp) == 2 and all(r["max_abs_diff_vs_one_device"] < 1e-4 for r in cp)
            assert all(r["speedup_vs_one_device"] > 0 and r["baseline"] == base for r in cp)
    else:
        assert {r["backend"] for r in measured} >= {"alltoall"}
        for r in measured:
            assert r["max_abs_diff"] < 1e-4  # combine(identity experts) gives x back
            assert r["effective_gbps"] > 0 and r["nccl_busbw_gbps"] > 0
            assert r["effective_device_gbps"] > 0 and r["nccl_device_busbw_gbps"] > 0
            assert min(r["remote_bytes_per_rank"]) > 0


def test_bench_takes_a_deepseek_v4_config_at_random_weights(runs):
    """Any supported config.json benches without a checkpoint, V4 included (its hash-routing
    tables drawn as distinct expert ids); its CP layout's logits match one rank."""
    proc, d = _result(runs, "v4")
    out = d / "v4-bench.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["tp=1", "tp=2,cp=2,ep=2,backend=alltoall_padded"]
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in rows)
    assert rows[1]["logits_max_abs_diff_vs_tp1"] < 1e-4 and rows[1]["top1_agrees_vs_tp1"]


def test_random_hash_tables_hold_distinct_expert_ids():
    from cpmoe.models.random_weights import RandomCheckpoint
    source = RandomCheckpoint({"t": (50, 3)}, 0, torch.device("cpu"), torch.float32,
                              int_ranges={"t": 5})
    t = source.get_slice("t")[:]
    assert t.dtype == torch.int64 and t.min() >= 0 and t.max() < 5
    assert all(len(set(row.tolist())) == 3 for row in t)


@pytest.mark.parametrize("command, run, out", [
    ("bench-one-batch", "bench-one-batch", "bench-one-batch.json"),
    ("bench-serving", "shared-prefix", "gsp.json")])
def test_decode_and_serving_benchmarks_write_provenance(runs, command, run, out):
    """The other two commands that write bench/results/ files, at tiny sizes on CPU."""
    proc, d = _result(runs, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = json.loads((d / out).read_text())["header"]
    _assert_provenance(head)
    assert head["command"].startswith(f"cpmoe {command} ") and "--out" in head["command"]


def test_random_dataset_draws_the_asked_number_of_prompts_within_the_lengths():
    """bench-serving --dataset random: prompt and output lengths drawn from
    [ratio * len, len], token ids below the vocabulary, the same requests for a seed."""
    import argparse

    from cpmoe.bench.serving import add_arguments, make_requests
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--dataset", "random", "--random-input-len", "40",
                         "--random-output-len", "6", "--random-range-ratio", "0.5",
                         "--num-prompts", "50", "--base-url", "http://unused", "--out", "unused"])
    reqs = make_requests(args, 300)
    assert len(reqs) == 50 and reqs == make_requests(args, 300)
    assert all(20 <= len(ids) <= 40 and 3 <= out <= 6 for ids, out in reqs)
    assert all(0 <= t < 300 for ids, _ in reqs for t in ids)
    assert len({len(ids) for ids, _ in reqs}) > 1  # lengths are drawn, not fixed
    args.seed += 1
    assert make_requests(args, 300) != reqs


def test_serving_benchmark_reports_the_prefix_cache_hit_rate(runs):
    """shared-prefix, one request at a time: every request after the first takes the
    32-token prefix from the server's cache, and the report says so."""
    proc, d = _result(runs, "shared-prefix")
    out = d / "gsp.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads(out.read_text())
    cached = [r["cached"] for r in body["requests"]]
    assert cached[0] == 0 and all(c >= 32 for c in cached[1:]), cached
    summary = body["summary"]
    assert summary["total_cached_tokens"] == sum(cached)
    assert summary["prefix_hit_rate"] == sum(cached) / summary["total_input_tokens"]
    assert "hit rate" in proc.stdout
    metrics = body["server_metrics"]
    assert metrics["cpmoe_prompt_tokens_cached_total"] == sum(cached)
    assert metrics["cpmoe_prompt_tokens_computed_total"] == (summary["total_input_tokens"]
                                                             - sum(cached))
    # the launched server's log is kept beside the results: its batch lines add up the same,
    # after the warm-up request's one prefill (its counters are not the run's)
    log = out.with_suffix(".server.log").read_text()
    logged = [(int(n), int(c)) for n, c in re.findall(
        r"Prefill batch\. #new-seq: \d+, #new-token: (\d+), #cached-token: (\d+)", log)]
    warmup = body["header"]["warmup_requests"]
    assert warmup == 1 and logged[0] == (body["requests"][0]["prompt_len"], 0)
    logged = logged[warmup:]
    assert sum(n for n, _ in logged) == metrics["cpmoe_prompt_tokens_computed_total"]
    assert sum(c for _, c in logged) == sum(cached)
    # TTFT's parts: every request's body went out before its first token came back, and
    # the server's own TTFT (arrival -> first token) is within what the client saw
    reqs = body["requests"]
    assert all(0 < r["sent"] < r["ttft"] for r in reqs), [(r["sent"], r["ttft"]) for r in reqs]
    assert 0 < summary["server_intake_s"] < summary["server_ttft_s"] < summary["ttft_s"]["mean"]
    assert "the server's own TTFT" in proc.stdout


def test_serving_benchmark_profiles_the_asked_steps_of_the_server(runs):
    """--profile --profile-num-steps 4: the launched server's rank writes a trace of its
    first 4 working steps of the load, each a named range, and its ops table."""
    proc, d = _result(runs, "shared-prefix")
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = json.loads((d / "gsp.json").read_text())["header"]["profile"]
    assert started["output_dir"] == str(d / "profile") and started["num_steps"] == 4
    trace = d / "profile" / f"{started['name']}-rank0.trace.json.gz"
    assert str(trace.parent / started["name"]) in proc.stdout
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    steps = [e["name"] for e in events if e.get("name", "").startswith("cpmoe step ")]
    working = [s for s in steps if not s.endswith(" idle")]
    assert len(working) == 4 and working[0].endswith(" prefill"), steps
    table = trace.with_name(f"{started['name']}-rank0.txt").read_text()
    assert table.startswith("4 steps\n") and "cpmoe step" in table
    assert "profile of 4 steps written" in (d / "gsp.server.log").read_text()


def test_serving_benchmark_refuses_profile_steps_without_profile():
    import argparse

    from cpmoe.bench.serving import add_arguments, run_bench_serving
    p = argparse.ArgumentParser()
    add_arguments(p)
    for extra in (["--profile-num-steps", "3"], ["--profile", "--profile-num-steps", "0"]):
        args = p.parse_args(["--base-url", "http://unused", "--out", "unused", *extra])
        with pytest.raises(BenchError, match="--profile-num-steps"):
            run_bench_serving(args, [])


def test_serving_benchmark_refuses_negative_warmup_requests():
    import argparse

    from cpmoe.bench.serving import add_arguments, run_bench_serving
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--base-url", "http://unused", "--out", "unused",
                         "--warmup-requests", "-1"])
    with pytest.raises(BenchError, match="--warmup-requests must be >= 0, got -1"):
        run_bench_serving(args, [])


# ---- --quantization fp8 (random weights quantized to 128x128 FP8 blocks at load; on CPU the
# model runs on the FP8-rounded weights) ----------------------------------------------------

def test_bench_takes_quantization_fp8(runs):
    proc, d = _result(runs, "fp8")
    out = d / "fp8.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"quantization": "fp8"' in out.read_text()  # in the run's header
    data = json.loads(out.read_text())
    assert all(r["error"] is None and r["tokens_per_s"] > 0 for r in data["rows"])


def test_bench_one_batch_takes_quantization_fp8(runs):
    proc, d = _result(runs, "bench-one-batch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp8" in (d / "bench-one-batch.json").read_text()
    rows = [r for r in json.loads((d / "bench-one-batch.json").read_text())["rows"]
            if "roofline_ms" in r]
    assert rows  # the roofline is the step's bytes over the bandwidth it names (CPU: H200's)
    for r in rows:
        assert r["hbm_bytes_per_s"] == 4.8e12
        assert r["roofline_ms"] == pytest.approx(r["step_bytes_busiest_rank"] / 4.8e9)


def test_one_batch_roofline_takes_the_cards_datasheet_bandwidth():
    from cpmoe.bench.one_batch import hbm_bytes_per_s
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bytes_per_s("NVIDIA H100 NVL") == 3.9e12
    assert hbm_bytes_per_s("cpu") == hbm_bytes_per_s("NVIDIA A100-SXM4-80GB") == 4.8e12


def test_kernel_sweeps_parse_their_tiles_and_refuse_a_wrong_count_in_one_line():
    from bench.decode_kernels import parse_tiles
    fields = "BLOCK_N:BLOCK_K:warps:stages:tma"
    # the decode experts' sweep: tma may be left out (0)
    assert parse_tiles("64:256:4:3,128:256:8:3:1,64:512:4:2:0", fields, optional=1) == [
        (64, 256, 4, 3, 0), (128, 256, 8, 3, 1), (64, 512, 4, 2, 0)]
    assert parse_tiles("64:4:3", "BLOCK_N:warps:stages") == [(64, 4, 3)]
    for text, optional in (("64:256:4", 1), ("64:256:4:3:1:1", 1), ("64:256:4:3", 0),
                           ("64:x:4:3", 1)):
        with pytest.raises(SystemExit) as e:
            parse_tiles(text, fields, optional)
        assert str(e.value) == f"--tiles: expected {fields}[,...], got {text!r}"


def test_one_batch_marks_its_timed_decode_steps_as_the_cuda_profilers_range(monkeypatch):
    """`ncu --profile-from-start off` (the decode-ncu part) profiles what lies between
    cudaProfilerStart and Stop: the timed steps, stopped even when a step raises; nothing is
    called on CPU."""
    from cpmoe.bench import one_batch
    calls = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    with one_batch.cuda_profiler_range(torch.device("cpu")):
        calls.append("cpu step")
    with one_batch.cuda_profiler_range(torch.device("cuda", 0)):
        calls.append("step")
    with pytest.raises(RuntimeError), one_batch.cuda_profiler_range(torch.device("cuda", 0)):
        calls.append("failing step")
        raise RuntimeError("a step failed")
    assert calls == ["cpu step", "start", "step", "stop", "start", "failing step", "stop"]
