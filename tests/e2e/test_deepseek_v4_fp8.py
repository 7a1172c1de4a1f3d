"""DeepSeek-V4 in its own FP8 format (FP8 projections with ue8m0 `.scale` in [16, 16]
blocks, MXFP4 routed experts: e2m1 two per byte, one ue8m0 scale per 32 inputs) loads and
equals HF transformers on the independently dequantized checkpoint (float32, 1e-4); where
accelerate is installed, also HF's own FP8 loading of the same files. MoE-TP that would cut
inside an MXFP4 scale group is refused before any rank starts; EP loads on a 2-rank layout
and equals one rank.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.models.registry import check_model_fit, load_model_config
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import LayoutError, ParallelLayout
from tests.distributed._v4_tasks import make_v4_model, v4_task
from tests.e2e._fp8_helpers import hf_logits, write_v4_fp8_checkpoint

TOL = 1e-4
LENGTHS = (1, 7, 130)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread


@pytest.fixture(scope="module")
def v4_fp8(tmp_path_factory):
    """(FP8 checkpoint dir, HF model on the dequantized weights)."""
    from transformers import DeepseekV4ForCausalLM
    fp8_dir = tmp_path_factory.mktemp("v4_fp8")
    deq_dir = tmp_path_factory.mktemp("v4_deq")
    make_v4_model("base", fp8_dir)
    write_v4_fp8_checkpoint(fp8_dir, [16, 16], deq_dir)
    hf = DeepseekV4ForCausalLM.from_pretrained(str(deq_dir), dtype=torch.float32).eval()
    return fp8_dir, hf


def seqs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


def test_v4_fp8_mxfp4_prefill_matches_dequantized_hf(v4_fp8):
    fp8_dir, hf = v4_fp8
    runner = ModelRunner(fp8_dir, ProcessGroups.single(), torch.float32, show_progress=False)
    assert runner.load_stats["scales"] > 0
    got = runner.prefill(seqs())
    diff = (got - hf_logits(hf, seqs())).abs().max().item()
    assert diff <= TOL, f"V4 FP8/MXFP4 logits differ from dequantized HF by {diff:.3e}"


def test_v4_fp8_matches_hf_own_fp8_loading(v4_fp8):
    pytest.importorskip("accelerate")
    from transformers import DeepseekV4ForCausalLM
    fp8_dir, _ = v4_fp8
    hf = DeepseekV4ForCausalLM.from_pretrained(str(fp8_dir), dtype=torch.float32).eval()
    runner = ModelRunner(fp8_dir, ProcessGroups.single(), torch.float32, show_progress=False)
    diff = (runner.prefill(seqs()) - hf_logits(hf, seqs())).abs().max().item()
    assert diff <= TOL, f"logits differ from HF's own FP8 loading by {diff:.3e}"


def test_v4_moe_tp_cutting_an_mxfp4_group_is_refused(v4_fp8):
    cfg, _ = load_model_config(v4_fp8[0])
    assert cfg.quantization.expert_dtype == "fp4"
    with pytest.raises(LayoutError) as e:
        check_model_fit(ParallelLayout(tp_size=2, attn_cp_size=2), cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert "moe_intermediate_size 32 / moe_tp 2 = 16 is not a multiple of the scale block " \
           "32 (weight blocks [1, 32])" in msg and "--ep-size 2" in msg


def test_v4_fp8_ep_layout_matches_single_rank(v4_fp8, pools):
    fp8_dir, _ = v4_fp8
    layout = ParallelLayout(tp_size=2, attn_cp_size=2, ep_size=2)
    check_model_fit(layout, load_model_config(fp8_dir)[0])
    # the session's 2-rank pool (tests/conftest.py): no interpreters of its own
    got = pools(2).run(v4_task, layout, {"fp8": fp8_dir}, seqs(), 3)[0]["fp8"]
    from tests.distributed._v4_tasks import greedy_run
    want = greedy_run(ProcessGroups.single(), fp8_dir, seqs(), 3)
    diff = (got["prefill"] - want["prefill"]).abs().max().item()
    assert diff <= 1e-5, f"EP 2 prefill differs from one rank by {diff:.3e}"
    assert got["tokens"] == want["tokens"]
