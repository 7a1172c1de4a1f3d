"""FP8 checkpoints load on the layouts of the matrix (a subset by default, see FP8_LAYOUTS)
and equal the one-rank run (gloo, fp32).

The checkpoints are the tiny Qwen3-MoE and Qwen2-MoE FP8 variants "aligned" (blocks that
divide every dim) and "partial" (tests/e2e/_fp8_helpers.py: [16, 8] and [8, 8] blocks,
hidden rows or shared-expert rows ending in a half block); every layout of the matrix cuts
both on block boundaries. Each rank
reads its slices of the FP8 weights with the slices of their scale grids and dequantizes
them. The one-rank logits equal HF transformers holding the independently dequantized
weights within 1e-4; every layout's prefill logits and decode-step logits equal the one-rank
run within 1e-5, and its greedy tokens are the same.
"""

from __future__ import annotations

import pytest

from cpmoe.parallel.groups import ProcessGroups
from tests._full import full_matrix
from tests.distributed._model_tasks import layout_task, run_model
from tests.distributed.test_layouts import (  # noqa: F401 -- shared module fixtures
    MATRIX, assert_matches_reference, layout_id, seqs)
from tests.e2e._fp8_helpers import hf_logits, make_fp8_checkpoint

NEW_TOKENS = 4
# The suite's budget (15 minutes on 2 cores) takes one layout of each kind that cuts FP8
# weights and scales differently: attention TP 1 / 2 / 8, MoE-TP 2 / 4 / 8 (tp8-cp1: the
# finest cuts, the one 8-rank layout), EP (none, alltoall), EP x MoE-TP, MoE-DP, both CP
# strategies and CP 1 / 2 (CP cuts no weight). CPMOE_FULL=1 runs all 48 layouts (the `full`
# marker), among them tp8-cp8-dp1-ep8-none-zigzag (EP with one expert per rank: EP moves
# whole experts, as tp4-cp2-dp1-ep4-alltoall-zigzag's two per rank; CP 8 is test_layouts').
FP8_LAYOUTS = {"tp2-cp1-dp1-ep1-none-zigzag", "tp2-cp2-dp1-ep2-none-interleave",
               "tp4-cp2-dp1-ep1-none-interleave", "tp4-cp2-dp1-ep2-none-zigzag",
               "tp4-cp2-dp1-ep4-alltoall-zigzag", "tp4-cp2-dp2-ep2-none-interleave",
               "tp8-cp1-dp1-ep1-none-zigzag"}
LAYOUTS = full_matrix(MATRIX, lambda lay: layout_id(lay) in FP8_LAYOUTS)
HF_TOL = 1e-4
KINDS = [(k, v) for v in ("aligned", "partial") for k in ("qwen3_moe", "qwen2_moe")]


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    return {f"{k}-{v}": make_fp8_checkpoint(k, v, tmp_path_factory.mktemp(f"fp8-{k}-{v}"))
            for k, v in KINDS}


@pytest.fixture(scope="module")
def dirs(fp8_models):
    return {k: d for k, (_, d) in fp8_models.items()}


@pytest.fixture(scope="module")
def reference(fp8_models, dirs, seqs):
    return {k: run_model(ProcessGroups.single(), d, seqs, NEW_TOKENS) for k, d in dirs.items()}


def test_fp8_one_rank_matches_dequantized_hf(fp8_models, reference, seqs):
    for kind, (hf_model, _) in fp8_models.items():
        diff = (reference[kind]["prefill"] - hf_logits(hf_model, seqs)).abs().max().item()
        assert diff <= HF_TOL, f"{kind}: one-rank FP8 logits differ from HF by {diff:.3e}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_fp8_layout_matches_single_rank(layout, pools, reference, dirs, seqs):
    got = pools(layout.world_size).run(layout_task, layout, dirs, seqs, NEW_TOKENS)[0]
    assert_matches_reference(got, reference)


def test_fp8_subset_names_layouts_of_the_matrix():
    assert FP8_LAYOUTS <= {layout_id(lay) for lay in MATRIX}
