"""FP8 (128x128-style block) checkpoints in the hub layout load on one rank and equal HF.

- prefill logits of Qwen3-MoE and Qwen2-MoE FP8 checkpoints, blocks dividing every dim and
  blocks leaving partial last blocks (rectangular [16, 8]), equal HF transformers holding
  the independently dequantized weights, within 1e-4 (float32);
- the same checkpoint through HF transformers' own FP8 loading (dequantize on CPU) gives
  the same logits (where accelerate is installed; HF requires dividing blocks);
- malformed inputs each get one line: a missing scale, a scale of the wrong shape, a scale
  without its weight, an unknown quant_method, a layout cutting inside a block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpmoe.config import ConfigError
from cpmoe.engine.runner import ModelRunner
from cpmoe.loader import LoadError
from cpmoe.models.registry import check_model_fit, load_model_config
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import LayoutError, ParallelLayout
from tests.e2e._fp8_helpers import VARIANTS, hf_logits, make_fp8_checkpoint

TOL = 1e-4
LENGTHS = (9, 1, 23)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    cache = {}

    def get(kind: str, variant: str):
        if (kind, variant) not in cache:
            cache[kind, variant] = make_fp8_checkpoint(
                kind, variant, tmp_path_factory.mktemp(f"{kind}-{variant}"))
        return cache[kind, variant]

    return get


def seqs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


def single(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, ProcessGroups.single(), torch.float32, show_progress=False)


@pytest.mark.parametrize("kind,variant", sorted(VARIANTS))
def test_fp8_prefill_matches_dequantized_hf(fp8_checkpoint, kind, variant):
    hf_model, model_dir = fp8_checkpoint(kind, variant)
    runner = single(model_dir)
    assert runner.load_stats["scales"] > 0
    got = runner.prefill(seqs())
    diff = (got - hf_logits(hf_model, seqs())).abs().max().item()
    assert diff <= TOL, f"{kind} {variant}: logits differ from dequantized HF by {diff:.3e}"


def test_fp8_matches_hf_own_fp8_loading(fp8_checkpoint):
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    _, model_dir = fp8_checkpoint("qwen3_moe", "divides")
    hf = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True,
                                                 weight_block_size=(32, 32))).eval()
    want = hf_logits(hf, seqs())
    got = single(model_dir).prefill(seqs())
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"logits differ from HF's own FP8 loading by {diff:.3e}"


# ---- malformed inputs: one line each ------------------------------------------------------

def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"


def test_missing_scale_is_refused(fp8_checkpoint, tmp_path):
    _, src = fp8_checkpoint("qwen3_moe", "divides")
    d = _copy_dir(src, tmp_path / "m")
    _edit_tensors(d, lambda s: s.pop(SCALE))
    with pytest.raises(LoadError) as e:
        single(d)
    msg = _one_line(e)
    assert "'model.layers.0.self_attn.q_proj.weight' is float8_e4m3fn" in msg
    assert "no scale" in msg


def test_scale_of_wrong_shape_is_refused(fp8_checkpoint, tmp_path):
    _, src = fp8_checkpoint("qwen3_moe", "divides")
    d = _copy_dir(src, tmp_path / "m")
    _edit_tensors(d, lambda s: s.__setitem__(SCALE, s[SCALE][:, :1].contiguous()))
    with pytest.raises(LoadError) as e:
        single(d)
    msg = _one_line(e)
    assert SCALE in msg and "[4, 1], expected [4, 2]" in msg and "[32, 32]" in msg


def test_scale_without_weight_is_refused(fp8_checkpoint, tmp_path):
    _, src = fp8_checkpoint("qwen3_moe", "divides")
    d = _copy_dir(src, tmp_path / "m")
    _edit_tensors(d, lambda s: s.__setitem__("model.layers.0.self_attn.x_proj.weight_scale_inv",
                                             s[SCALE].clone()))
    with pytest.raises(LoadError) as e:
        single(d)
    assert "scale tensor 'model.layers.0.self_attn.x_proj.weight_scale_inv' has no weight" in \
        _one_line(e)


def test_experts_scale_covered_by_completeness(fp8_checkpoint, tmp_path):
    """An expert's scale dropped on a rank that does not own the expert is still caught."""
    _, src = fp8_checkpoint("qwen3_moe", "divides")
    d = _copy_dir(src, tmp_path / "m")
    name = "model.layers.2.mlp.experts.7.down_proj.weight_scale_inv"
    _edit_tensors(d, lambda s: s.pop(name))
    with pytest.raises(LoadError) as e:
        single(d)
    assert "'model.layers.2.mlp.experts.7.down_proj.weight' is float8_e4m3fn" in _one_line(e)


def test_unknown_quant_method_is_refused(fp8_checkpoint, tmp_path):
    _, src = fp8_checkpoint("qwen3_moe", "divides")
    d = _copy_dir(src, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "awq"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model_config(d)
    assert ("quantization_config.quant_method 'awq' is not supported (only 'fp8', or "
            "'compressed-tensors' with a kv_cache_scheme only)") in _one_line(e)


def test_layout_cutting_a_block_is_refused_naming_sizes(fp8_checkpoint):
    _, d = fp8_checkpoint("qwen3_moe", "divides")  # blocks [32, 32], heads of 16 rows
    cfg, _ = load_model_config(d)
    check_model_fit(ParallelLayout(tp_size=4, attn_cp_size=4), cfg)  # 128 / 4 on a boundary
    with pytest.raises(LayoutError) as e:
        check_model_fit(ParallelLayout(tp_size=8, attn_cp_size=8), cfg)
    msg = _one_line(e)
    assert "moe_intermediate_size 128 / moe_tp 8 = 16 is not a multiple of the scale block " \
           "32" in msg and "--ep-size 8" in msg
    check_model_fit(ParallelLayout(tp_size=8, attn_cp_size=8, ep_size=8), cfg)  # EP: whole
    with pytest.raises(LayoutError) as e:  # attention TP 2: one 16-row KV head per rank
        check_model_fit(ParallelLayout(tp_size=2, ep_size=2), cfg)
    assert "k_proj.weight: attention TP 2 cuts its output rows into pieces of 16, not a " \
           "multiple of the scale block 32" in _one_line(e)


# ---- --quantization fp8 and the plan ------------------------------------------------------

def test_online_fp8_matches_hf_with_block_rounded_weights(make_hf_checkpoint):
    """--quantization fp8 on CPU: every projection is rounded to [128, 128] FP8 blocks (the
    tiny widths make one partial block per tensor); HF holding the same rounding, done by
    the test's own quantizer, gives the same logits."""
    from tests.e2e._fp8_helpers import dequantize_blocks, quantize_blocks
    hf_model, d = make_hf_checkpoint("qwen3_moe")
    runner = ModelRunner(d, ProcessGroups.single(), torch.float32, show_progress=False,
                         quantization="fp8")
    import copy
    ref = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_proj.weight") or name.endswith(("gate_up_proj", "down_proj")):
                mats = p.view(-1, *p.shape[-2:])
                for m in mats:
                    m.copy_(dequantize_blocks(*quantize_blocks(m, [128, 128]), [128, 128]))
    got = runner.prefill(seqs())
    diff = (got - hf_logits(ref, seqs())).abs().max().item()
    assert diff <= TOL, f"online FP8 logits differ from block-rounded HF by {diff:.3e}"
    plain = single(d).prefill(seqs())
    assert (got - plain).abs().max().item() > 10 * TOL  # the rounding did happen


def test_plan_reports_fp8_weight_bytes(fp8_checkpoint, make_hf_checkpoint, capsys):
    from cpmoe.cli import main
    _, d = fp8_checkpoint("qwen3_moe", "divides")
    assert main(["plan", "--model", str(d), "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)["memory_per_rank"][0]
    fp8 = mem["fp8_on_cuda"]
    assert 0 < fp8["fp8_bytes"] < fp8["weight_bytes"] < mem["weight_bytes"]
    _, bf16_dir = make_hf_checkpoint("qwen3_moe")
    assert main(["plan", "--model", str(bf16_dir), "--quantization", "fp8"]) == 0
    assert "GiB FP8 weights + scales" in capsys.readouterr().out


def test_cli_refuses_a_layout_cutting_a_block_before_spawning(fp8_checkpoint, capsys):
    from cpmoe.cli import main
    _, d = fp8_checkpoint("qwen3_moe", "divides")
    capsys.readouterr()  # the fixture's own output
    assert main(["plan", "--model", str(d), "--tp-size", "8", "--attn-cp-size", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe_tp 8 = 16 is not a multiple of the scale block 32" in err[0]


def test_generate_takes_quantization_fp8_and_fp8_checkpoints(fp8_checkpoint, make_hf_checkpoint,
                                                             capsys):
    from cpmoe.cli import main
    _, bf16_dir = make_hf_checkpoint("qwen3_moe")
    _, fp8_dir = fp8_checkpoint("qwen3_moe", "divides")
    for model, extra in ((bf16_dir, ["--quantization", "fp8"]), (fp8_dir, [])):
        assert main(["generate", "--model", str(model), "--input-ids", "1,2,3", "--device",
                     "cpu", "--max-new-tokens", "2", "--json", "--verbose", *extra]) == 0
        assert len(json.loads(capsys.readouterr().out)[0]["tokens"]) == 2


@pytest.mark.parametrize("change,message", [
    ({"fmt": "e5m2"}, "quantization_config.fmt 'e5m2' is not supported (only 'e4m3')"),
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({"weight_block_size": None}, "weight_block_size must be two positive integers [bn, bk] "
                                  "(per-tensor FP8 is not supported), got None"),
    ({"weight_block_size": [128, 0]}, "got [128, 0]"),
    ({"expert_dtype": "int4"}, "expert_dtype 'int4' is not supported"),
])
def test_quantization_config_fields_are_checked(change, message):
    from cpmoe.config import parse_quantization
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128], **change}
    with pytest.raises(ConfigError) as e:
        parse_quantization({"quantization_config": q}, "m/config.json")
    assert message in _one_line(e) and "m/config.json" in str(e.value)
    ok = parse_quantization({"quantization_config": {"quant_method": "fp8",
                                                     "weight_block_size": [128, 64],
                                                     "modules_to_not_convert": ["lm_head"]}})
    assert ok.block == (128, 64) and not ok.converts("lm_head") and ok.converts("model.x")


def test_cli_prints_one_line_for_a_checkpoint_missing_a_scale(fp8_checkpoint, tmp_path,
                                                              capsys):
    from cpmoe.cli import main
    _, src = fp8_checkpoint("qwen3_moe", "divides")
    d = _copy_dir(src, tmp_path / "m")
    _edit_tensors(d, lambda s: s.pop(SCALE))
    capsys.readouterr()  # the fixture's own output
    assert main(["generate", "--model", str(d), "--input-ids", "1,2", "--device", "cpu",
                 "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is float8_e4m3fn but the checkpoint has no scale" in err[0]
