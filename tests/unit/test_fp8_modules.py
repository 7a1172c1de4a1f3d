"""FP8 parameters (the CUDA layout) filled by the loader, checked on CPU.

- `prepare_fp8` turns exactly the modules whose checkpoint weights carry scales (and whose
  shard is whole blocks) into FP8 modules; the loader copies each rank's FP8 slice and the
  slice of its scale grid as they are: dequantizing them gives exactly the weights that
  the dequantize-at-load path gives, one rank and a CP x MoE-TP shard alike, and the
  completeness proof covers the scale parameters.
- The whole FP8 forward (Fp8Linear, the FP8 experts branch, Triton kernels in the CPU
  interpreter) follows the dequantized model within the FP8 activation tolerance.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.loader import LoadError, load_checkpoint, quantized_weight_names
from cpmoe.models.registry import load_model_config
from cpmoe.parallel.layout import ParallelLayout
from cpmoe.ops.fp8 import dequantize
from cpmoe.quant.modules import Fp8Linear, prepare_fp8
from tests._interpreter import run_interpreted
from tests.e2e._fp8_helpers import make_fp8_checkpoint
from tests.unit.test_loader import rank_groups


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_fp8_checkpoint("qwen3_moe", "divides", tmp_path_factory.mktemp("fp8"))[1]


def build(d, layout: ParallelLayout, rank: int, fp8: bool):
    cfg, cls = load_model_config(d)
    model = cls(cfg, rank_groups(layout, rank), torch.float32)
    n = prepare_fp8(model, quantized_weight_names(d), cfg.quantization) if fp8 else 0
    load_checkpoint(model, d, show_progress=False, tied_embeddings=cfg.tie_word_embeddings,
                    quantization=cfg.quantization)
    return model, n


def dense_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as the compute dtype sees it (FP8 ones dequantized)."""
    out = {}
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        prefix, _, attr = name.rpartition(".")
        m = modules[prefix]
        if attr.endswith("scale_inv"):
            continue
        if p.dtype != torch.float8_e4m3fn:
            out[name] = p
        elif isinstance(m, Fp8Linear):
            out[name] = dequantize(p, m.weight_scale_inv, m.block)
        else:  # experts
            s = getattr(m, attr.removesuffix("_proj") + "_scale_inv")
            out[name] = torch.stack([dequantize(p[e], s[e], m.fp8_block)
                                     for e in range(p.shape[0])])
    return out


@pytest.mark.parametrize("layout,rank", [(ParallelLayout(), 0),
                                         (ParallelLayout(tp_size=2, attn_cp_size=2), 1)],
                         ids=["one-rank", "cp2-moe_tp2-rank1"])
def test_fp8_parameters_dequantize_to_the_dequantized_load(fp8_dir, layout, rank):
    fp8, n = build(fp8_dir, layout, rank, fp8=True)
    assert n > 0 and any(isinstance(m, Fp8Linear) for m in fp8.modules())
    assert fp8.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    plain, _ = build(fp8_dir, layout, rank, fp8=False)
    got, want = dense_params(fp8), dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_fp8_scale_parameters_are_in_the_completeness_proof(fp8_dir, tmp_path):
    """A weight whose scale lands nowhere is reported, not left as uninitialised memory."""
    cfg, cls = load_model_config(fp8_dir)
    model = cls(cfg, rank_groups(ParallelLayout(), 0), torch.float32)
    names = quantized_weight_names(fp8_dir)
    prepare_fp8(model, names, cfg.quantization)
    # an FP8 parameter whose checkpoint tensor is gone: the parameter and its scale stay empty
    import shutil

    from safetensors.torch import load_file, save_file
    d = tmp_path / "m"
    shutil.copytree(fp8_dir, d)
    state = load_file(str(d / "model.safetensors"))
    state.pop("model.layers.0.self_attn.o_proj.weight")
    state.pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LoadError) as e:
        load_checkpoint(model, d, show_progress=False, quantization=cfg.quantization)
    assert "lacks" in str(e.value) and "o_proj" in str(e.value)


_FORWARD = r"""
import sys, torch
from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
d = sys.argv[1]
plain = ModelRunner(d, ProcessGroups.single(), torch.float32, show_progress=False)
ModelRunner._keep_fp8 = lambda self: True  # the CUDA choice, on the interpreter
fp8 = ModelRunner(d, ProcessGroups.single(), torch.float32, show_progress=False)
assert any(p.dtype == torch.float8_e4m3fn for p in fp8.model.parameters())
seqs = [[3, 1, 4, 1, 5, 9, 2, 6], [7] * 3]
a, b = fp8.prefill(seqs), plain.prefill(seqs)
rel = ((a - b).norm() / b.norm()).item()
assert rel < 0.1, rel
print("fp8 forward ok", rel)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_fp8_forward_follows_dequantized_model_in_the_interpreter(fp8_dir):
    out = run_interpreted(_FORWARD, str(fp8_dir), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fp8 forward ok" in out.stdout


def test_uniform_routing_scales_fp8_residual_writers_through_their_scales(fp8_dir):
    """--routing uniform scales o_proj / down_proj by RESIDUAL_SCALE: on FP8 weights (no
    FP8 multiply on CUDA) their block scales are scaled instead: the same weights up to
    float32 rounding."""
    from cpmoe.moe.uniform_routing import RESIDUAL_SCALE, calibrate_uniform_routing
    fp8, _ = build(fp8_dir, ParallelLayout(), 0, fp8=True)
    plain, _ = build(fp8_dir, ParallelLayout(), 0, fp8=False)
    groups = rank_groups(ParallelLayout(), 0)
    for model in (fp8, plain):
        calibrate_uniform_routing(model, groups, lambda: None)
    got, want = dense_params(fp8), dict(plain.named_parameters())
    o = "model.layers.0.self_attn.o_proj.weight"
    torch.testing.assert_close(got[o], want[o], rtol=1e-6, atol=0)
    d = "model.layers.0.mlp.experts.down_proj"
    torch.testing.assert_close(got[d], want[d], rtol=1e-6, atol=0)
    assert RESIDUAL_SCALE != 1


def test_fused_fp8_projections_equal_the_separate_ones_and_share_their_tensors():
    """fuse_linears over FP8 linears (q/k/v on CUDA): one FP8 GEMM whose output is the
    separate modules' outputs side by side, the modules' weights and scales now views of
    the fused tensors; output widths that are not whole 128-row scale blocks do not fuse."""
    from cpmoe.linear import Linear, fuse_linears
    from cpmoe.ops.fp8 import quantize_block_fp8
    from cpmoe.quant.modules import Fp8Linear
    torch.manual_seed(0)
    linears = []
    for n in (256, 128, 128):
        dense = Linear(256, n, bias=False, dtype=torch.float32)
        torch.nn.init.normal_(dense.weight)
        fp8 = Fp8Linear(dense, (128, 128))
        q, s = quantize_block_fp8(dense.weight.data)
        fp8.weight.data.copy_(q)
        fp8.weight_scale_inv.data.copy_(s)
        linears.append(fp8)
    x = torch.randn(5, 256)
    want = torch.cat([m(x) for m in linears], dim=-1)
    fused = fuse_linears(linears)
    assert torch.equal(fused(x), want)
    assert linears[1].weight.data_ptr() == linears[0].weight.data_ptr() + 256 * 256
    assert linears[2].weight_scale_inv.data_ptr() == \
        linears[0].weight_scale_inv.data_ptr() + 3 * 2 * 4
    odd = Linear(256, 64, bias=False, dtype=torch.float32)
    assert fuse_linears([linears[0], Fp8Linear(odd, (128, 128))]) is None
