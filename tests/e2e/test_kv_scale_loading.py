"""Checkpoint K/V-cache scales (cpmoe/quant/kv_scales.py): the three name forms hub FP8
checkpoints use land in each attention layer's `kv_scale` buffer; a scale that is not one
positive finite float, a layer given a scale twice, a checkpoint with scales for some layers
only, and scales in a model without K/V pools are refused with one line naming the tensor;
the runner says when FP8 pools have no scales and when scales go unused (as SGLang and vLLM
warn). That the scales are applied where K/V are stored and read is tests/e2e/
test_hf_parity.py's (against HF) and tests/distributed/test_decode.py's (over CP shards)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sizing import kv_scale_note
from cpmoe.loader import LoadError
from cpmoe.parallel.groups import ProcessGroups
from tests.e2e._fp8_helpers import KV_SCALES, with_kv_scales


def runner_of(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, ProcessGroups.single(), torch.float32, show_progress=False)


@pytest.fixture(scope="module")
def scaled_dir(qwen3_moe_dir, tmp_path_factory):
    return with_kv_scales(qwen3_moe_dir, tmp_path_factory.mktemp("scaled") / "m")


def edited(scaled_dir, tmp_path, edit):
    """A copy of the scaled checkpoint with its tensors changed by edit(state)."""
    import shutil
    d = tmp_path / "edited"
    shutil.copytree(scaled_dir, d)
    state = load_file(str(d / "model.safetensors"))
    edit(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_every_name_form_fills_its_layers_scales(scaled_dir):
    runner = runner_of(scaled_dir)
    assert runner.load_stats["kv_scales"] == len(KV_SCALES)
    for layer, (k, v, _) in zip(runner.model.model.layers, KV_SCALES):
        want = torch.tensor([k, v], dtype=torch.float32)
        assert layer.self_attn.kv_scale.tolist() == torch.cat([want, 1.0 / want]).tolist()


L0 = "model.layers.0.self_attn"


def _set(name, value):
    return lambda s: s.__setitem__(name, value)


@pytest.mark.parametrize("edit, message", [
    (_set(f"{L0}.k_scale", torch.tensor([0.5, 0.5])),
     f"K/V-cache scale '{L0}.k_scale' is F32 [2], expected one float"),
    (_set(f"{L0}.k_scale", torch.tensor(3, dtype=torch.int32)),
     f"K/V-cache scale '{L0}.k_scale' is I32 [], expected one float"),
    (_set(f"{L0}.v_scale", torch.tensor(-0.2)),
     f"K/V-cache scale '{L0}.v_scale' is -0.2"),
    (_set(f"{L0}.v_scale", torch.tensor(float("nan"))),
     f"K/V-cache scale '{L0}.v_scale' is nan, expected a positive finite number"),
    (_set(f"{L0}.k_proj.k_scale", torch.tensor(0.5)),
     f"gives {L0} a second k_scale"),
    (lambda s: s.pop("model.layers.2.self_attn.kv_scale"),
     "none for model.layers.2.self_attn.k_scale (every attention layer needs k_scale and "
     "v_scale, or none may have them)"),
    (_set("model.layers.9.self_attn.k_scale", torch.tensor(0.5)),
     "unexpected tensor 'model.layers.9.self_attn.k_scale'"),
])
def test_bad_kv_scales_are_refused_in_one_line(scaled_dir, tmp_path, edit, message):
    d = edited(scaled_dir, tmp_path, edit)
    with pytest.raises(LoadError) as e:
        runner_of(d)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_model_without_kv_pools_refuses_them(tmp_path):
    from tests.distributed._v4_tasks import make_v4_model
    _, d = make_v4_model("base", tmp_path / "v4")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadError) as e:
        runner_of(d)
    assert "'model.layers.0.self_attn.k_scale' is a K/V-cache scale, but" in str(e.value)
    assert "keeps no K/V pools" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_runner_says_when_scales_are_missing_or_unused(scaled_dir, qwen3_moe_dir,
                                                           capsys):
    assert kv_scale_note("auto", 0) is None and kv_scale_note("fp8_e4m3", 3) is None
    capsys.readouterr()
    runner_of(qwen3_moe_dir).allocate_kv(64, kv_dtype="fp8_e4m3")
    err = capsys.readouterr().err
    assert "--kv-cache-dtype fp8_e4m3: the checkpoint has no k_scale/v_scale" in err
    runner_of(scaled_dir).allocate_kv(64, kv_dtype="auto")
    assert "k_scale/v_scale (3 layers) are unused" in capsys.readouterr().err
    runner_of(scaled_dir).allocate_kv(64, kv_dtype="fp8_e4m3")
    assert capsys.readouterr().err == ""


KV_ONLY = {"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense",
           "quantization_status": "frozen", "ignore": ["lm_head"],
           "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                               "dynamic": False, "symmetric": True}}


def with_config(model_dir, quantization_config: dict):
    import json
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"] = quantization_config
    path.write_text(json.dumps(cfg))
    return model_dir


def test_a_kv_cache_only_compressed_tensors_checkpoint_loads_its_scales(scaled_dir, tmp_path):
    """llm-compressor's K/V-cache-only output (16-bit weights, kv_cache_scheme, k_scale /
    v_scale): weights load as they are (no FP8), the scales as above; a dummy load of its
    config quantizes nothing either."""
    d = with_config(edited(scaled_dir, tmp_path, lambda s: None), KV_ONLY)
    runner = runner_of(d)
    assert runner.config.quantization is None and runner.load_stats["kv_scales"] == 3
    assert runner.model.model.layers[1].self_attn.kv_scale[:2].tolist() == pytest.approx(
        [0.77, 3.1])
    plain = runner_of(scaled_dir)
    for a, b in zip(runner.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)
    dummy = ModelRunner(d, ProcessGroups.single(), torch.float32, load_format="dummy")
    assert dummy.config.quantization is None


@pytest.mark.parametrize("change, message", [
    ({"config_groups": {"group_0": {"targets": ["Linear"]}}},
     "config_groups: compressed-tensors weight quantization is not supported"),
    ({"kv_cache_scheme": dict(KV_ONLY["kv_cache_scheme"], strategy="attn_head")},
     "kv_cache_scheme.strategy 'attn_head' is not supported (only 'tensor'"),
    ({"kv_cache_scheme": dict(KV_ONLY["kv_cache_scheme"], num_bits=4)},
     "kv_cache_scheme.num_bits 4 is not supported"),
    ({"kv_cache_scheme": dict(KV_ONLY["kv_cache_scheme"], dynamic=True)},
     "kv_cache_scheme.dynamic True is not supported"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported (only 'fp8', or "
                              "'compressed-tensors' with a kv_cache_scheme only)"),
])
def test_other_compressed_tensors_configs_are_refused_in_one_line(change, message):
    from cpmoe.config import ConfigError, parse_quantization
    with pytest.raises(ConfigError) as e:
        parse_quantization({"quantization_config": {**KV_ONLY, **change}}, "m/config.json")
    assert message in str(e.value) and "m/config.json" in str(e.value)
    assert "\n" not in str(e.value)
