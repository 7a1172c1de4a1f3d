"""Tests for the built-in tiny Qwen3-MoE checkpoint (cpmoe.default_model)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cpmoe import default_model as dm

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def shared_model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One checkpoint created through ensure_default_model, shared by the read-only tests."""
    cache = tmp_path_factory.mktemp("cpmoe_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPMOE_CACHE_DIR", str(cache))
        start = time.perf_counter()
        path = dm.ensure_default_model()
        print(f"\nbuilt-in model created in {time.perf_counter() - start:.2f}s; "
              f"model.safetensors = {(path / 'model.safetensors').stat().st_size} bytes")
    assert path == cache / f"{dm.DEFAULT_MODEL_NAME}-v2"
    return path


def test_default_model_dir_honours_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("CPMOE_CACHE_DIR", str(tmp_path))
    assert dm.default_model_dir() == tmp_path / "cpmoe-tiny-qwen3-moe-v2"
    monkeypatch.delenv("CPMOE_CACHE_DIR")
    assert dm.default_model_dir() == pathlib.Path.home() / ".cache/cpmoe/cpmoe-tiny-qwen3-moe-v2"


def test_config_is_hub_style(shared_model_dir: pathlib.Path) -> None:
    cfg = json.loads((shared_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    expected = {"vocab_size": 259, "hidden_size": 128, "num_hidden_layers": 4, "num_experts": 16,
                "num_experts_per_tok": 4, "head_dim": 16, "rope_theta": 1000000.0,
                "moe_intermediate_size": 64, "eos_token_id": 256, "torch_dtype": "float32"}
    assert {k: cfg[k] for k in expected} == expected
    gen_cfg = json.loads((shared_model_dir / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == 256


def test_hf_loads_with_no_missing_keys_and_forward_is_finite(shared_model_dir: pathlib.Path) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(shared_model_dir, output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    with torch.no_grad():
        out = model(torch.tensor([[1, 72, 101, 108, 108, 111, 256]]), output_router_logits=True)
    assert out.logits.shape == (1, 7, 259)
    assert torch.isfinite(out.logits).all()
    assert 0.1 < out.logits.std().item() < 10.0  # activations stay O(1)
    # Routing is decisive: the k-th and (k+1)-th router probabilities are not near-tied.
    probs = torch.cat(out.router_logits).softmax(-1).topk(5, dim=-1).values
    assert (probs[:, 3] - probs[:, 4]).mean().item() > 1e-2


def test_tokenizer_loads_and_round_trips(shared_model_dir: pathlib.Path) -> None:
    tok = AutoTokenizer.from_pretrained(shared_model_dir)
    assert len(tok) == 259 and tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == 256 and tok.pad_token_id == 256
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [257, 258]
    for text in ["hello world", "héllo 世界", "  tabs\tand\nnewlines  ", "emoji 🙂!", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 257 and ids[-1] == 258
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_weights_are_byte_identical_across_creations(
    shared_model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    dm.write_tiny_qwen3_moe(tmp_path / "again")
    other = tmp_path / "again" / "model.safetensors"
    assert _sha256(other) == _sha256(shared_model_dir / "model.safetensors")


def test_second_call_reuses_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("CPMOE_CACHE_DIR", str(tmp_path))
    first = dm.ensure_default_model()
    stamp = (first / "model.safetensors").stat().st_mtime_ns, first.stat().st_mtime_ns
    second = dm.ensure_default_model()
    assert second == first
    assert ((second / "model.safetensors").stat().st_mtime_ns, second.stat().st_mtime_ns) == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no temp dirs left behind


def test_leftovers_of_a_crashed_creation_do_not_break_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("CPMOE_CACHE_DIR", str(tmp_path))
    target = dm.default_model_dir()
    fresh_tmp = tmp_path / f".{target.name}.tmp-99999-deadbeef"  # maybe a live creator: keep it
    stale_tmp = tmp_path / f".{target.name}.tmp-99998-cafebabe"  # hours old: cleaned up
    for tmp in (fresh_tmp, stale_tmp):
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"truncated")
    old = time.time() - 2 * 3600
    os.utime(stale_tmp, (old, old))
    target.mkdir()  # a half-written target (not ours): replaced, never trusted
    (target / "config.json").write_text("{")
    path = dm.ensure_default_model()
    assert path == target and fresh_tmp.exists() and not stale_tmp.exists()
    json.loads((path / "config.json").read_text())
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_concurrent_creators_agree(tmp_path: pathlib.Path) -> None:
    code = ("from cpmoe.default_model import ensure_default_model as e; import hashlib; "
            "p = e(); print(p, hashlib.sha256((p / 'model.safetensors').read_bytes()).hexdigest())")
    env = {**os.environ, "CPMOE_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    # two creators race for the rename (each is an interpreter, a torch import and a build)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert len({out.strip() for out, _ in results}) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpmoe-tiny-qwen3-moe-v2"]


def test_writer_accepts_config_overrides(tmp_path: pathlib.Path) -> None:
    dm.write_tiny_qwen3_moe(tmp_path, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_hidden_layers == 2 and model.config.num_experts == 8
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()
    with pytest.raises(ValueError):
        dm.write_tiny_qwen3_moe(tmp_path / "bad", vocab_size=100)


def test_dense_layer_override_writes_a_checkpoint_cpmoe_loads(tmp_path):
    """The writer follows the model's checkpoint table, so a dense layer gets an MLP, not
    experts, and cpmoe's loader accepts every tensor."""
    import torch

    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups
    dm.write_tiny_qwen3_moe(tmp_path, num_hidden_layers=2, mlp_only_layers=[1])
    runner = ModelRunner(tmp_path, ProcessGroups.single(), torch.float32, show_progress=False)
    assert runner.load_stats["skipped"] == 0
    assert torch.isfinite(runner.prefill([[1, 2, 3]])).all()
