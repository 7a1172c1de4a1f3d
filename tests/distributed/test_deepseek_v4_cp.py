"""DeepSeek-V4 under context parallelism equals the one-rank run and HF transformers (gloo,
float32).

One rank pool per world size (2, 4, 8: tests/conftest.py `pools`) reused by every case
of that size. Prompts of lengths
300, 120, 1 and 7: 300 gives CSA entries past the indexer's top-k and HCA entries, 120 + 16
crosses the HCA boundary while decoding, 1 and 7 leave some CP ranks without tokens.

- every V4 layout (attn_cp == tp; backends none and alltoall; EP, MoE-TP and coupled MoE;
  interleave and zigzag): prefill logits of all positions and every decode step's logits
  within 1e-5 of one rank and within 1e-4 of HF (each prompt alone, HF's cached `generate`),
  and the same 16 greedy tokens as both (the 8-rank alltoall layout only with
  CPMOE_FULL=1). The fixture's indexer has 2 heads (`_v4_tasks`): most top-k choices are
  among exactly tied scores, so this also proves each layout picks what HF picks;
- shared expert counted once: with every routed expert zeroed, the output is the shared
  expert's alone, so a shared output summed over ranks would be off by the group size;
- hash routing follows the rows: with only hash-routed layers' experts non-zero, token ids
  misaligned with hidden rows under CP would pick other experts;
- experts re-placed by recorded load (weights moved between EP ranks, router and hash-table
  ids mapped) give the same outputs;
- invalid V4 layouts are refused before any rank starts, each with its own one-line message.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4.config import check_v4_layout
from cpmoe.models.registry import check_model_fit, load_model_config
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import LayoutError, ParallelLayout
from tests._full import full_matrix
from tests.distributed._v4_tasks import greedy_run, make_v4_model, v4_task
from tests.e2e._hf_helpers import hf_greedy_run

LENGTHS = [300, 120, 1, 7]
NEW_TOKENS = 16
SHORT_LENGTHS, SHORT_NEW_TOKENS = [200, 9], 4
TOL = 1e-5
HF_TOL = 1e-4  # one rank vs HF: the same math in another order (fp64 where cpmoe merges)


def lay(tp: int, backend: str, ep: int, strategy: str, moe_dp: int = 1) -> ParallelLayout:
    return ParallelLayout(tp_size=tp, attn_cp_size=tp, moe_dp_size=moe_dp, ep_size=ep,
                          moe_a2a_backend=backend, cp_strategy=strategy)


EXPLICIT = [lay(4, "none", 4, "interleave"), lay(4, "alltoall", 4, "interleave")]
MATRIX = [
    *EXPLICIT,
    lay(4, "none", 1, "zigzag", moe_dp=4),  # coupled: each rank runs every expert on its rows
    lay(4, "none", 2, "zigzag"),  # EP 2 x MoE-TP 2 (moe_dp 1), MoE group == CP group
    lay(2, "none", 2, "interleave"),
    lay(2, "alltoall", 2, "zigzag"),
    lay(2, "alltoall_padded", 2, "interleave"),
    lay(2, "none", 1, "zigzag"),  # MoE-TP 2: each expert's intermediate dim split
    lay(8, "none", 8, "interleave"),
    lay(8, "alltoall", 8, "interleave"),
]
# The default run (2-core budget) keeps one 8-rank layout; alltoall runs at 2 and 4 ranks.
V4_DEFAULT = [x for x in MATRIX if (x.tp_size, x.moe_a2a_backend) != (8, "alltoall")]


def layout_id(lay: ParallelLayout) -> str:
    return (f"tp{lay.tp_size}-cp{lay.attn_cp_size}-dp{lay.moe_dp_size}-ep{lay.ep_size}-"
            f"{lay.moe_a2a_backend}-{lay.cp_strategy}")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread


@pytest.fixture(scope="module")
def v4_models(tmp_path_factory) -> dict:
    """variant -> (HF model, checkpoint dir)."""
    return {v: make_v4_model(v, tmp_path_factory.mktemp(f"v4_{v}"))
            for v in ("base", "shared_only", "hash_only")}


@pytest.fixture(scope="module")
def v4_dirs(v4_models) -> dict:
    return {v: d for v, (_, d) in v4_models.items()}


def random_ids(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def seqs() -> list[list[int]]:
    return random_ids(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def short_seqs() -> list[list[int]]:
    return random_ids(SHORT_LENGTHS, seed=8)


@pytest.fixture(scope="module")
def reference(v4_models, seqs, short_seqs) -> dict:
    """variant -> {"one": the one-rank run, "hf": HF's} on that variant's prompts."""
    single, out = ProcessGroups.single(), {}
    for v, (hf_model, d) in v4_models.items():
        prompts, steps = (seqs, NEW_TOKENS) if v == "base" else (short_seqs, SHORT_NEW_TOKENS)
        out[v] = {"one": greedy_run(single, d, prompts, steps),
                  "hf": hf_greedy_run(hf_model, prompts, steps)}
    return out


def _assert_close(got: dict, want: dict, tol: float, what: str, whom: str) -> None:
    diff = (got["prefill"] - want["prefill"]).abs().max().item()
    assert diff <= tol, f"{what}: prefill logits differ from {whom} by {diff:.3e}"
    assert len(got["steps"]) == len(want["steps"])
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
        d = (a - b).abs().max().item()
        assert d <= tol, f"{what}: decode step {i} logits differ from {whom} by {d:.3e}"
    assert got["tokens"] == want["tokens"], f"{what}: greedy tokens differ from {whom}"


def assert_same(got: dict, ref: dict, what: str) -> None:
    """got within TOL of the one-rank run and within HF_TOL of HF."""
    _assert_close(got, ref["one"], TOL, what, "one rank")
    _assert_close(got, ref["hf"], HF_TOL, what, "HF")


def test_one_rank_matches_hf(reference):
    for v, ref in reference.items():
        _assert_close(ref["one"], ref["hf"], HF_TOL, f"{v} one rank", "HF")


# ---- layout validation (no processes) -------------------------------------------------------

INVALID = [
    (ParallelLayout(tp_size=2, attn_cp_size=1, ep_size=2),
     "--attn-cp-size 1 must equal --tp-size 2"),
    (ParallelLayout(tp_size=4, attn_cp_size=2, ep_size=4),
     "--attn-cp-size 2 must equal --tp-size 4"),
    (ParallelLayout(tp_size=8, attn_cp_size=4, ep_size=8, moe_a2a_backend="alltoall"),
     "--attn-cp-size 4 must equal --tp-size 8"),
]
for _backend, _module in (("deepep", "deep_ep"), ("mori", "mori")):
    if importlib.util.find_spec(_module) is None:
        INVALID.append((ParallelLayout(tp_size=2, attn_cp_size=2, ep_size=2,
                                       moe_a2a_backend=_backend),
                        f"--moe-a2a-backend {_backend} needs the Python package"))


@pytest.mark.parametrize("layout, words", INVALID, ids=[layout_id(x) for x, _ in INVALID])
def test_invalid_v4_layout_is_refused(layout, words, v4_dirs):
    cfg, _ = load_model_config(v4_dirs["base"])
    for check in (lambda: check_v4_layout(layout), lambda: check_model_fit(layout, cfg)):
        with pytest.raises(LayoutError, match=words) as err:
            check()
        assert "\n" not in str(err.value)


def test_invalid_v4_layouts_have_distinct_messages():
    messages = set()
    for layout, _ in INVALID:
        with pytest.raises(LayoutError) as err:
            check_v4_layout(layout)
        messages.add(str(err.value))
    assert len(messages) == len(INVALID)


def test_v4_layouts_under_test_are_valid(v4_dirs):
    cfg, _ = load_model_config(v4_dirs["base"])
    for layout in MATRIX:
        check_model_fit(layout, cfg)


# ---- multi-rank runs ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", EXPLICIT, ids=layout_id)
def test_shared_expert_counted_once_under_cp(layout, pools, v4_dirs, short_seqs, reference):
    ref = reference["shared_only"]
    # The control: in this checkpoint the shared expert carries the whole MoE output.
    runner = ModelRunner(v4_dirs["shared_only"], ProcessGroups.single(), torch.float32,
                         show_progress=False)
    for layer in runner.model.model.layers:
        layer.mlp.shared_experts.down_proj.weight.mul_(2.0)
    doubled = runner.prefill(short_seqs)
    assert (doubled - ref["one"]["prefill"]).abs().max().item() > 1e-2
    got = pools(layout.world_size).run(v4_task, layout, {"v": v4_dirs["shared_only"]},
                                       short_seqs, SHORT_NEW_TOKENS)[0]["v"]
    assert_same(got, ref, f"shared-only {layout_id(layout)}")


@pytest.mark.parametrize("layout", EXPLICIT, ids=layout_id)
def test_hash_routing_ids_follow_rows_under_cp(layout, pools, v4_dirs, short_seqs, reference):
    ref = reference["hash_only"]
    # The control: in this checkpoint the token-id -> expert table decides the output.
    runner = ModelRunner(v4_dirs["hash_only"], ProcessGroups.single(), torch.float32,
                         show_progress=False)
    for layer in runner.model.model.layers:
        if layer.mlp.hashed:
            layer.mlp.gate.tid2eid.copy_(layer.mlp.gate.tid2eid.roll(1, dims=0))
    shifted = runner.prefill(short_seqs)
    assert (shifted - ref["one"]["prefill"]).abs().max().item() > 1e-2
    got = pools(layout.world_size).run(v4_task, layout, {"v": v4_dirs["hash_only"]},
                                       short_seqs, SHORT_NEW_TOKENS)[0]["v"]
    assert_same(got, ref, f"hash-only {layout_id(layout)}")


@pytest.mark.parametrize("layout", EXPLICIT, ids=layout_id)
def test_v4_rebalanced_experts_give_the_same_outputs(layout, pools, v4_dirs, seqs, reference):
    calibration = random_ids([150, 40], seed=9)
    got = pools(layout.world_size).run(v4_task, layout, {"v": v4_dirs["base"]}, seqs,
                                       NEW_TOKENS, calibration)[0]["v"]
    report = got["report"]
    assert report.experts_moved > 0, "the placement did not change"
    assert report.busiest_after < report.busiest_before
    assert_same(got, reference["base"], f"rebalanced {layout_id(layout)}")


@pytest.mark.parametrize("layout", full_matrix(MATRIX, lambda x: x in V4_DEFAULT),
                         ids=layout_id)
def test_v4_layout_matches_single_rank(layout, pools, v4_dirs, seqs, reference):
    got = pools(layout.world_size).run(v4_task, layout, {"v": v4_dirs["base"]}, seqs,
                                       NEW_TOKENS)[0]["v"]
    assert_same(got, reference["base"], layout_id(layout))
