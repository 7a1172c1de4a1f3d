"""Which collectives each layout issues (counted per group kind by cpmoe.parallel.comm), and
how process groups alias one another."""

from __future__ import annotations

import pytest

from cpmoe.parallel.layout import ParallelLayout
from tests.distributed._model_tasks import groups_task, layout_task, step_stats_task
from tests.distributed.test_layouts import LENGTHS, seqs  # noqa: F401  (fixtures)

# The qwen3_moe fixture: 3 layers, layer 1 dense (mlp_only_layers=[1]).
LAYERS, SPARSE = 3, 2


def _prefill_stats(pools, layout, model_dir, seqs):  # noqa: F811
    out = pools(layout.world_size).run(layout_task, layout, {"m": model_dir}, seqs, 0)
    return [r["m"]["stats"] for r in out]


def test_moe_full_gathers_once_over_cp_and_reduces_once_over_moe_group(pools, qwen3_moe_dir,
                                                                        seqs):  # noqa: F811
    layout = ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4)
    for stats in _prefill_stats(pools, layout, qwen3_moe_dir, seqs):
        # per layer one K/V all-gather, per sparse layer one MOE_FULL gather, one for logits
        assert stats["attn_cp"] == {"all_gather": LAYERS + SPARSE + 1}
        # the MoE reduction: one all-reduce per sparse layer over the MoE group (all 4 ranks)
        assert stats["moe"] == {"all_reduce": SPARSE}
        # o_proj partials of every layer and the dense MLP, inside attention TP
        assert stats["attn_tp"] == {"all_reduce": LAYERS + 1}
        assert set(stats) == {"attn_cp", "moe", "attn_tp"}


def test_moe_full_reduce_scatters_when_the_expert_shards_are_the_cp_ranks(  # noqa: F811
        pools, qwen3_moe_dir, seqs):  # noqa: F811
    layout = ParallelLayout(tp_size=2, attn_cp_size=2, moe_dp_size=1, ep_size=2)
    for stats in _prefill_stats(pools, layout, qwen3_moe_dir, seqs):
        # each CP rank keeps the sum of its own chunk: half the bytes of an all-reduce
        assert stats["attn_cp"] == {"all_gather": LAYERS + SPARSE + 1,
                                    "reduce_scatter": SPARSE}
        assert set(stats) == {"attn_cp"}


def test_alltoall_moe_issues_no_cp_collective(pools, qwen3_moe_dir, seqs):  # noqa: F811
    layout = ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4,
                            moe_a2a_backend="alltoall")
    for stats in _prefill_stats(pools, layout, qwen3_moe_dir, seqs):
        assert stats["attn_cp"] == {"all_gather": LAYERS + 1}  # K/V and logits only
        # dispatch: counts + packed rows (hidden, ids, weights); combine: rows back
        assert stats["moe_ep"] == {"exchange_counts": SPARSE, "all_to_all": 2 * SPARSE}
        assert stats["attn_tp"] == {"all_reduce": LAYERS + 1, "all_gather": SPARSE}
        assert "moe" not in stats


def test_padded_moe_gathers_and_reduce_scatters_over_ep(pools, qwen3_moe_dir,  # noqa: F811
                                                        seqs):  # noqa: F811
    layout = ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4,
                            moe_a2a_backend="alltoall_padded")
    for stats in _prefill_stats(pools, layout, qwen3_moe_dir, seqs):
        assert stats["moe_ep"] == {"all_gather": SPARSE, "reduce_scatter": SPARSE}
        assert "moe" not in stats


def test_coupled_moe_reduces_inside_attention_tp_group(pools, qwen3_moe_dir, seqs):  # noqa: F811
    layout = ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=2)
    for stats in _prefill_stats(pools, layout, qwen3_moe_dir, seqs):
        assert stats["attn_cp"] == {"all_gather": LAYERS + 1}
        assert stats["moe"] == {"all_reduce": SPARSE}


# EP x MoE-TP with moe_dp 1: the expert shards tile the whole TP group ("moe"), so each
# sparse layer reduces once over it -- never over MOE_EP and then MOE_TP.
HYBRID = [ParallelLayout(tp_size=4, ep_size=2),
          ParallelLayout(tp_size=4, attn_cp_size=2, ep_size=2, cp_strategy="interleave"),
          ParallelLayout(tp_size=4, attn_cp_size=4, ep_size=2),
          ParallelLayout(tp_size=8, attn_cp_size=2, ep_size=4)]


def _hybrid_id(lay: ParallelLayout) -> str:
    return f"tp{lay.tp_size}-cp{lay.attn_cp_size}-ep{lay.ep_size}"


@pytest.mark.parametrize("layout", HYBRID, ids=_hybrid_id)
def test_ep_x_moe_tp_reduces_once_per_sparse_layer(pools, qwen2_moe_dir, seqs,  # noqa: F811
                                                   layout):
    """Prefill and decode: one all-reduce over the MoE group per sparse layer, nothing on
    the EP or MoE-TP groups; every other collective as in the other decoupled layouts.
    (Qwen2-MoE: layer 2 dense, the shared expert added after the reduction.)"""
    tp, cp = layout.tp_size, layout.attn_cp_size
    assert layout.group_members("moe") == [list(range(tp))]
    for stats in pools(layout.world_size).run(step_stats_task, layout, qwen2_moe_dir, seqs):
        pre, dec = stats["prefill"], stats["decode"]
        for step in (pre, dec):
            assert "moe_ep" not in step and "moe_tp" not in step, step
            if tp > cp:  # o_proj partials of every layer and the dense MLP
                assert step["attn_tp"] == {"all_reduce": LAYERS + 1}, step
        assert dec["moe"] == {"all_reduce": SPARSE}
        if cp == 1:
            assert pre["moe"] == {"all_reduce": SPARSE}
            assert set(pre) == set(dec) == {"moe", "attn_tp"}
            continue
        # prefill: K/V per layer, the MOE_FULL gather per sparse layer, the output rows; the
        # MoE reduction is an all-reduce over the MoE group, or a reduce-scatter over CP when
        # the MoE group is the CP group (every rank keeps only its own chunk's sum)
        if tp == cp:
            assert pre["attn_cp"] == {"all_gather": LAYERS + SPARSE + 1,
                                      "reduce_scatter": SPARSE}
            assert "moe" not in pre
        else:
            assert pre["attn_cp"] == {"all_gather": LAYERS + SPARSE + 1}
            assert pre["moe"] == {"all_reduce": SPARSE}
        # decode: the LSE merge of every layer and the dense layer's rows split over CP
        assert dec["attn_cp"] == {"all_gather": LAYERS + 1}
        attn_tp = {"attn_tp"} if tp > cp else set()
        assert set(pre) == {"attn_cp", *attn_tp} | ({"moe"} if tp > cp else set())
        assert set(dec) == {"moe", "attn_cp", *attn_tp}


@pytest.mark.parametrize("layout, aliases, worlds", [
    (ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4),
     {("attn_cp", "moe_dp"), ("moe", "moe_ep")}, {"moe_ep", "moe"}),
    (ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=2),
     {("attn_cp", "moe_dp"), ("attn_tp", "moe"), ("attn_tp", "moe_ep"), ("moe", "moe_ep")},
     set()),
    (ParallelLayout(tp_size=4, attn_cp_size=4, moe_dp_size=1, ep_size=4),
     {("attn_cp", "moe_dp"), ("attn_cp", "moe_ep"), ("attn_cp", "moe"), ("moe", "moe_ep"),
      ("moe_dp", "moe_ep"), ("moe", "moe_dp")}, {"attn_cp", "moe_dp", "moe_ep", "moe"}),
], ids=["decoupled", "coupled", "cp-equals-tp"])
def test_groups_alias_instead_of_duplicating(pools, layout, aliases, worlds):  # noqa: F811
    for rank, out in enumerate(pools(layout.world_size).run(groups_task, layout)):
        for kind, members in out["members"].items():
            assert members == layout.group_of(kind, rank)
        shared = {pair for pair, same in out["same_pg"].items() if same}
        assert shared == aliases
        assert {k for k, w in out["is_world"].items() if w} == worlds
