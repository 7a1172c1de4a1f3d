"""Tests for cpmoe.parallel.layout: sizes, validation, model fit, coordinates, groups, summary.

Pure: no processes, no torch.distributed. Expected values come from the reference
(/work/shared/notes/parallel-semantics.md sections 1-2), written out independently of the
implementation's formulas where possible.
"""

from __future__ import annotations

import itertools
import json

import pytest

from cpmoe.parallel.layout import (BACKENDS, CP_STRATEGIES, GROUP_KINDS, RANK_LOCAL_BACKENDS,
                                   LayoutError, ParallelLayout)

# ---- helpers ----------------------------------------------------------------------------


def valid_layouts(tp_sizes=(1, 2, 4, 8)) -> list[ParallelLayout]:
    """Every valid layout (backend 'none' and, where allowed, 'alltoall') for the tp sizes."""
    out = []
    for tp in tp_sizes:
        divisors = [d for d in range(1, tp + 1) if tp % d == 0]
        for cp, dp, ep in itertools.product(divisors, divisors, divisors):
            for backend in ("none", "alltoall"):
                try:
                    out.append(ParallelLayout(tp_size=tp, attn_cp_size=cp, moe_dp_size=dp,
                                              ep_size=ep, moe_a2a_backend=backend))
                except LayoutError:
                    pass
    return out


def _rule_ok(tp, cp, dp, ep, backend="none") -> bool:
    """The reference's validation rules, restated."""
    return (tp % cp == 0 and tp % dp == 0 and dp in (1, cp) and ep * dp <= tp
            and (dp == 1 or ep == 1 or ep * dp == tp)  # SGLang: only checked when moe_dp > 1
            and tp % ep == 0  # moe_dp 1: any ep dividing tp, moe_tp = tp / ep
            and (backend not in RANK_LOCAL_BACKENDS or ep == tp))


def _one_line(msg: str) -> None:
    assert msg and "\n" not in msg and msg == msg.strip(), repr(msg)


ALL_VALID = valid_layouts()


def _id(layout: ParallelLayout) -> str:
    return (f"tp{layout.tp_size}-cp{layout.attn_cp_size}-dp{layout.moe_dp_size}"
            f"-ep{layout.ep_size}-{layout.moe_a2a_backend}")


# ---- worked examples of the reference ---------------------------------------------------


def test_worked_example_tp4_cp2_ep4():
    lay = ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4)
    assert lay.group_members("attn_tp") == [[0, 1], [2, 3]]
    assert lay.group_members("attn_cp") == [[0, 2], [1, 3]]
    assert lay.group_members("moe_dp") == lay.group_members("attn_cp") == [[0, 2], [1, 3]]
    assert lay.group_members("moe_ep") == [[0, 1, 2, 3]]
    assert lay.group_members("moe_tp") == [[0], [1], [2], [3]]
    assert lay.group_members("moe") == [[0, 1, 2, 3]]
    assert lay.decoupled
    assert (lay.attn_tp_size, lay.moe_tp_size, lay.moe_group_size) == (2, 1, 4)


def test_worked_example_tp8_cp4_ep8():
    lay = ParallelLayout(tp_size=8, attn_cp_size=4, ep_size=8)
    assert lay.group_members("attn_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.group_members("attn_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.group_members("moe_dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # decoupled alias
    assert lay.group_members("moe_ep") == [list(range(8))]
    assert lay.group_members("moe_tp") == [[r] for r in range(8)]


def test_coupled_tp4_cp2_dp2_ep2_groups():
    lay = ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=2)
    assert not lay.decoupled
    assert lay.group_members("attn_tp") == [[0, 1], [2, 3]]
    assert lay.group_members("attn_cp") == [[0, 2], [1, 3]]
    assert lay.group_members("moe_ep") == [[0, 1], [2, 3]]  # inside each block of ep*moe_tp
    assert lay.group_members("moe_dp") == [[0, 2], [1, 3]]  # stride ep*moe_tp
    assert lay.group_members("moe_tp") == [[0], [1], [2], [3]]
    assert lay.group_members("moe") == [[0, 1], [2, 3]]


def test_hybrid_tp4_ep2_groups():
    # moe_dp 1, ep 2 -> moe_tp 2: each expert's intermediate dim over [0,1] and [2,3], the
    # experts over [0,2] and [1,3]; the two tile the MoE group, which is the whole TP group
    lay = ParallelLayout(tp_size=4, ep_size=2)
    assert (lay.attn_tp_size, lay.moe_tp_size, lay.moe_group_size) == (4, 2, 4)
    assert lay.group_members("moe_tp") == [[0, 1], [2, 3]]
    assert lay.group_members("moe_ep") == [[0, 2], [1, 3]]
    assert lay.group_members("moe") == [[0, 1, 2, 3]]
    assert lay.group_members("moe_dp") == [[0], [1], [2], [3]]


def test_hybrid_tp8_cp2_ep4_groups():
    # the example: tp 8, attn_cp 2, ep 4 -> moe_tp 2
    lay = ParallelLayout(tp_size=8, attn_cp_size=2, ep_size=4)
    assert (lay.attn_tp_size, lay.moe_tp_size, lay.moe_group_size) == (4, 2, 8)
    assert lay.decoupled
    assert lay.group_members("attn_tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.group_members("attn_cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.group_members("moe_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.group_members("moe_ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.group_members("moe_dp") == lay.group_members("attn_cp")
    assert lay.group_members("moe") == [list(range(8))]


def test_hybrid_tp8_cp4_ep2_groups():
    lay = ParallelLayout(tp_size=8, attn_cp_size=4, ep_size=2)
    assert (lay.attn_tp_size, lay.moe_tp_size) == (2, 4)
    assert lay.group_members("moe_tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.group_members("moe_ep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.group_members("attn_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_pure_moe_tp_groups():
    lay = ParallelLayout(tp_size=4, ep_size=1, moe_dp_size=1)
    assert lay.group_members("moe_tp") == [[0, 1, 2, 3]]
    assert lay.group_members("moe_ep") == [[0], [1], [2], [3]]
    assert lay.group_members("moe_dp") == [[0], [1], [2], [3]]
    assert lay.group_members("moe") == [[0, 1, 2, 3]]


def test_moe_tp_with_coupled_dp_groups():
    # tp8 cp2 dp2 ep1: attn_tp 4, moe_tp 4; MoE-TP blocks [0..3] [4..7], MoE-DP stride 4
    lay = ParallelLayout(tp_size=8, attn_cp_size=2, moe_dp_size=2, ep_size=1)
    assert lay.attn_tp_size == 4 and lay.moe_tp_size == 4
    assert lay.group_members("moe_tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.group_members("moe_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.group_members("attn_cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.group_members("attn_tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---- derived sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "tp, cp, dp, ep, attn_tp, moe_tp, moe_group",
    [
        (1, 1, 1, 1, 1, 1, 1),
        (2, 1, 1, 2, 2, 1, 2),
        (4, 1, 1, 4, 4, 1, 4),
        (4, 1, 1, 1, 4, 4, 4),  # pure MoE-TP
        (4, 2, 2, 2, 2, 1, 2),  # coupled
        (4, 2, 1, 4, 2, 1, 4),  # decoupled
        (4, 4, 1, 4, 1, 1, 4),  # all CP, EP over the whole replica
        (4, 2, 2, 1, 2, 2, 2),  # coupled, MoE-TP 2
        (8, 8, 1, 8, 1, 1, 8),
        (8, 8, 8, 1, 1, 1, 1),  # coupled, every rank a full MoE copy
        (8, 4, 1, 8, 2, 1, 8),
        (8, 2, 2, 4, 4, 1, 4),
        (8, 2, 2, 1, 4, 4, 4),
        (8, 1, 1, 1, 8, 8, 8),
        (4, 1, 1, 2, 4, 2, 4),  # EP x MoE-TP
        (4, 2, 1, 2, 2, 2, 4),
        (8, 2, 1, 4, 4, 2, 8),
        (8, 4, 1, 2, 2, 4, 8),
    ],
)
def test_derived_sizes(tp, cp, dp, ep, attn_tp, moe_tp, moe_group):
    lay = ParallelLayout(tp_size=tp, attn_cp_size=cp, moe_dp_size=dp, ep_size=ep)
    assert lay.world_size == tp
    assert lay.attn_tp_size == attn_tp
    assert lay.moe_tp_size == moe_tp
    assert lay.moe_group_size == moe_group
    assert lay.decoupled == (cp > dp)
    assert len(lay.group_members("moe")) == dp  # one full copy of the experts per MoE-DP rank


def test_defaults_are_one_rank():
    lay = ParallelLayout()
    assert (lay.tp_size, lay.attn_cp_size, lay.moe_dp_size, lay.ep_size) == (1, 1, 1, 1)
    assert (lay.moe_a2a_backend, lay.cp_strategy) == ("none", "zigzag")
    for kind in GROUP_KINDS:
        assert lay.group_members(kind) == [[0]]


# ---- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tp_size=4, attn_cp_size=2),
        dict(tp_size=4, attn_cp_size=4, moe_dp_size=4),
        dict(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=2),
        dict(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4),
        dict(tp_size=4, ep_size=4, moe_a2a_backend="alltoall"),
        dict(tp_size=4, attn_cp_size=4, ep_size=4, moe_a2a_backend="alltoall"),
        dict(tp_size=8, attn_cp_size=8, moe_dp_size=8, ep_size=1),
        dict(tp_size=2, cp_strategy="interleave"),
        dict(tp_size=1, moe_a2a_backend="alltoall"),  # ep == tp == 1
        # moe_dp 1: EP x MoE-TP (SGLang checks ep * moe_dp == tp only when moe_dp > 1)
        dict(tp_size=4, ep_size=2),
        dict(tp_size=4, attn_cp_size=2, ep_size=2),
        dict(tp_size=8, attn_cp_size=2, ep_size=4),
        dict(tp_size=8, attn_cp_size=4, ep_size=2),
        dict(tp_size=8, attn_cp_size=8, ep_size=2),
    ],
)
def test_valid_layouts_accepted(kwargs):
    ParallelLayout(**kwargs)


# (kwargs, flags the message must name, values it must name)
REJECTED = [
    pytest.param(dict(tp_size=4, attn_cp_size=3), ["--tp-size", "--attn-cp-size"], ["4", "3"],
                 id="tp%cp"),
    pytest.param(dict(tp_size=6, attn_cp_size=4), ["--tp-size", "--attn-cp-size"], ["6", "4"],
                 id="tp%cp-bigger"),
    pytest.param(dict(tp_size=4, attn_cp_size=1, moe_dp_size=3), ["--tp-size", "--moe-dp-size"],
                 ["4", "3"], id="tp%dp"),
    pytest.param(dict(tp_size=8, attn_cp_size=4, moe_dp_size=2),
                 ["--moe-dp-size", "--attn-cp-size"], ["2", "4"], id="dp-not-1-or-cp"),
    pytest.param(dict(tp_size=4, attn_cp_size=1, moe_dp_size=2),
                 ["--moe-dp-size", "--attn-cp-size"], ["2", "1"], id="dp-without-cp"),
    pytest.param(dict(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=4),
                 ["--ep-size", "--moe-dp-size", "--tp-size"], ["4", "2"], id="ep*dp>tp"),
    pytest.param(dict(tp_size=2, ep_size=4), ["--ep-size", "--tp-size"], ["4", "2"],
                 id="ep>tp"),
    pytest.param(dict(tp_size=4, ep_size=3), ["--ep-size", "--tp-size"], ["3", "4"],
                 id="ep-not-dividing-tp"),
    pytest.param(dict(tp_size=8, attn_cp_size=2, ep_size=3), ["--ep-size", "--tp-size"],
                 ["3", "8"], id="ep-not-dividing-tp-cp"),
    pytest.param(dict(tp_size=8, attn_cp_size=2, moe_dp_size=2, ep_size=2),
                 ["--ep-size", "--moe-dp-size", "--tp-size"], ["2", "8"],
                 id="ep*dp<tp-coupled"),
    pytest.param(dict(tp_size=4, ep_size=1, moe_a2a_backend="alltoall"),
                 ["--moe-a2a-backend", "--ep-size", "--tp-size"], ["alltoall", "1", "4"],
                 id="alltoall-needs-ep-eq-tp"),
    pytest.param(dict(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=1,
                      moe_a2a_backend="deepep"),
                 ["--moe-a2a-backend", "--ep-size"], ["deepep", "1", "4"],
                 id="deepep-needs-ep-eq-tp"),
    pytest.param(dict(tp_size=4, ep_size=2, moe_a2a_backend="alltoall"),
                 ["--moe-a2a-backend", "--ep-size", "--tp-size", "none"],
                 ["alltoall", "2", "4"], id="alltoall-refuses-ep-x-moe-tp"),
    pytest.param(dict(tp_size=8, attn_cp_size=2, ep_size=4, moe_a2a_backend="alltoall_padded"),
                 ["--moe-a2a-backend", "--ep-size", "--tp-size", "none"],
                 ["alltoall_padded", "4", "8"], id="padded-refuses-ep-x-moe-tp"),
    pytest.param(dict(tp_size=2, ep_size=1, moe_a2a_backend="mori"),
                 ["--moe-a2a-backend", "--ep-size"], ["mori", "1", "2"],
                 id="mori-needs-ep-eq-tp"),
    pytest.param(dict(tp_size=0), ["--tp-size"], ["0"], id="tp0"),
    pytest.param(dict(tp_size=-2), ["--tp-size"], ["-2"], id="tp-neg"),
    pytest.param(dict(attn_cp_size=0), ["--attn-cp-size"], ["0"], id="cp0"),
    pytest.param(dict(moe_dp_size=-1), ["--moe-dp-size"], ["-1"], id="dp-neg"),
    pytest.param(dict(ep_size=0), ["--ep-size"], ["0"], id="ep0"),
    pytest.param(dict(tp_size=2.0), ["--tp-size"], ["2.0"], id="tp-float"),
    pytest.param(dict(ep_size="2"), ["--ep-size"], ["'2'"], id="ep-str"),
    pytest.param(dict(moe_a2a_backend="nccl"), ["--moe-a2a-backend"], ["nccl"],
                 id="unknown-backend"),
    pytest.param(dict(cp_strategy="ring"), ["--cp-strategy"], ["ring"], id="unknown-cp"),
]


@pytest.mark.parametrize("kwargs, flags, values", REJECTED)
def test_invalid_layouts_rejected(kwargs, flags, values):
    with pytest.raises(LayoutError) as info:
        ParallelLayout(**kwargs)
    msg = str(info.value)
    _one_line(msg)
    for flag in flags:
        assert flag in msg, (flag, msg)
    for value in values:
        assert value in msg, (value, msg)


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_unknown_backend_message_lists_choices():
    with pytest.raises(LayoutError) as info:
        ParallelLayout(moe_a2a_backend="nccl")
    for b in BACKENDS:
        assert b in str(info.value)
    with pytest.raises(LayoutError) as info:
        ParallelLayout(cp_strategy="ring")
    for s in CP_STRATEGIES:
        assert s in str(info.value)


def test_validation_matches_reference_rules_exhaustively():
    """For every combination of sizes 1..8 and both backends, accepted iff the rules say so."""
    for tp, cp, dp, ep in itertools.product(range(1, 9), repeat=4):
        for backend in ("none", "alltoall"):
            ok = _rule_ok(tp, cp, dp, ep, backend)
            try:
                ParallelLayout(tp_size=tp, attn_cp_size=cp, moe_dp_size=dp, ep_size=ep,
                               moe_a2a_backend=backend)
                accepted = True
            except LayoutError as e:
                _one_line(str(e))
                accepted = False
            assert accepted == ok, (tp, cp, dp, ep, backend)


def test_layout_is_frozen():
    lay = ParallelLayout(tp_size=2, ep_size=2)
    with pytest.raises(Exception):
        lay.tp_size = 4  # type: ignore[misc]


# ---- model fit --------------------------------------------------------------------------

FIT = dict(num_experts=8, num_attention_heads=8, num_key_value_heads=2,
           moe_intermediate_size=32)


@pytest.mark.parametrize(
    "layout_kwargs, model_overrides",
    [
        (dict(tp_size=2, ep_size=2), {}),  # kv 2 == attn_tp 2: split
        (dict(tp_size=4, ep_size=4), {}),  # kv 2 < attn_tp 4: replicated, 4 % 2 == 0
        (dict(tp_size=8, ep_size=8), {}),  # kv 2 < attn_tp 8, experts 8 % 8
        (dict(tp_size=8, attn_cp_size=4, ep_size=8), {}),  # attn_tp 2
        (dict(tp_size=4, ep_size=1), {}),  # moe_tp 4 divides 32
        (dict(tp_size=8, attn_cp_size=8, moe_dp_size=8), dict(num_key_value_heads=1)),
        (dict(tp_size=2, ep_size=2), dict(num_key_value_heads=8)),  # kv 8 split over 2
        (dict(tp_size=4, ep_size=4), dict(num_experts=0, moe_intermediate_size=0)),  # dense
        (dict(tp_size=8, ep_size=1), dict(num_attention_heads=16, moe_intermediate_size=8)),
    ],
)
def test_model_fit_accepted(layout_kwargs, model_overrides):
    ParallelLayout(**layout_kwargs).check_model(**{**FIT, **model_overrides})


@pytest.mark.parametrize(
    "layout_kwargs, model_overrides, names",
    [
        pytest.param(dict(tp_size=4, ep_size=4), dict(num_experts=6),
                     ["--ep-size", "4", "num_experts", "6"], id="experts%ep"),
        pytest.param(dict(tp_size=8, ep_size=8), dict(num_experts=12),
                     ["--ep-size", "8", "num_experts", "12"], id="experts%ep8"),
        pytest.param(dict(tp_size=4, ep_size=4), dict(num_attention_heads=6),
                     ["--tp-size", "--attn-cp-size", "num_attention_heads", "6", "4"],
                     id="heads%attn_tp"),
        pytest.param(dict(tp_size=8, attn_cp_size=2, moe_dp_size=2, ep_size=4),
                     dict(num_attention_heads=6),
                     ["--tp-size", "--attn-cp-size", "num_attention_heads", "6", "4"],
                     id="heads%attn_tp-cp"),
        pytest.param(dict(tp_size=2, ep_size=2), dict(num_key_value_heads=3),
                     ["num_key_value_heads", "3", "2"], id="kv-more-not-divisible"),
        pytest.param(dict(tp_size=4, ep_size=4), dict(num_key_value_heads=3),
                     ["num_key_value_heads", "3", "4"], id="kv-fewer-not-dividing"),
        pytest.param(dict(tp_size=8, ep_size=8), dict(num_key_value_heads=6),
                     ["num_key_value_heads", "6", "8"], id="kv6-tp8"),
        pytest.param(dict(tp_size=4, ep_size=1), dict(moe_intermediate_size=30),
                     ["--tp-size", "--ep-size", "--moe-dp-size", "moe_intermediate_size",
                      "30", "4"], id="inter%moe_tp"),
        pytest.param(dict(tp_size=8, attn_cp_size=2, moe_dp_size=2, ep_size=1),
                     dict(moe_intermediate_size=34),
                     ["moe_intermediate_size", "34", "4"], id="inter%moe_tp-coupled"),
    ],
)
def test_model_fit_rejected(layout_kwargs, model_overrides, names):
    with pytest.raises(LayoutError) as info:
        ParallelLayout(**layout_kwargs).check_model(**{**FIT, **model_overrides})
    msg = str(info.value)
    _one_line(msg)
    for name in names:
        assert name in msg, (name, msg)


def test_model_fit_ignores_moe_rules_for_dense_models():
    # no experts: neither ep nor moe_tp constrain anything
    ParallelLayout(tp_size=4, ep_size=4).check_model(
        num_experts=0, num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=7)


def test_check_model_fit_dense_intermediate():
    """Dense MLP layers are sharded over attention TP (ParallelLayout.check_model, given
    the dense layers by check_model_fit)."""
    from cpmoe.models.qwen_moe.config import QwenMoeConfig
    from cpmoe.models.registry import check_model_fit

    def cfg(intermediate: int, mlp_only: tuple[int, ...]) -> QwenMoeConfig:
        return QwenMoeConfig(
            architecture="Qwen3MoeForCausalLM", vocab_size=256, hidden_size=64,
            intermediate_size=intermediate, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=mlp_only, shared_expert_intermediate_size=0, qkv_bias=False,
            qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
            eos_token_ids=(), max_position_embeddings=4096)

    lay = ParallelLayout(tp_size=4, ep_size=4)
    check_model_fit(lay, cfg(128, (1,)))
    check_model_fit(lay, cfg(130, ()))  # no dense layer: intermediate_size unused
    with pytest.raises(LayoutError) as info:
        check_model_fit(lay, cfg(130, (1,)))
    _one_line(str(info.value))
    assert "intermediate_size 130" in str(info.value) and "4" in str(info.value)


# ---- coordinates and groups, for every valid layout with tp in {1, 2, 4, 8} --------------


def test_enumeration_covers_interesting_layouts():
    ids = {_id(lay) for lay in ALL_VALID}
    for want in ("tp1-cp1-dp1-ep1-none", "tp4-cp2-dp1-ep4-none", "tp4-cp2-dp2-ep2-none",
                 "tp8-cp4-dp1-ep8-alltoall", "tp8-cp8-dp8-ep1-none", "tp8-cp2-dp2-ep1-none",
                 "tp4-cp1-dp1-ep2-none", "tp4-cp2-dp1-ep2-none", "tp8-cp2-dp1-ep4-none",
                 "tp8-cp4-dp1-ep2-none"):
        assert want in ids
    assert len(ALL_VALID) == sum(
        _rule_ok(lay_tp, cp, dp, ep, b)
        for lay_tp in (1, 2, 4, 8)
        for cp, dp, ep in itertools.product(range(1, lay_tp + 1), repeat=3)
        for b in ("none", "alltoall"))


@pytest.mark.parametrize("lay", ALL_VALID, ids=_id)
def test_coordinates_follow_formulas(lay: ParallelLayout):
    tp, atp, mtp, ep = lay.tp_size, lay.attn_tp_size, lay.moe_tp_size, lay.ep_size
    seen = set()
    for r in range(tp):
        c = lay.coords(r)
        assert c["attn_tp"] == r % atp
        assert c["attn_cp"] == r // atp
        assert c["moe_tp"] == r % mtp
        assert c["moe_ep"] == (r // mtp) % ep
        assert c["moe_dp"] == r // (ep * mtp)
        assert 0 <= c["attn_cp"] < lay.attn_cp_size
        assert 0 <= c["moe_dp"] < lay.moe_dp_size
        # the MoE coordinates name each rank uniquely, and so do the attention ones
        seen.add((c["moe_dp"], c["moe_ep"], c["moe_tp"]))
    assert len(seen) == tp
    assert len({(lay.coords(r)["attn_cp"], lay.coords(r)["attn_tp"]) for r in range(tp)}) == tp
    with pytest.raises(ValueError):
        lay.coords(tp)
    with pytest.raises(ValueError):
        lay.coords(-1)


# Which coordinate varies inside a group of each kind (its index = the rank's position).
_VARYING = {"attn_tp": "attn_tp", "attn_cp": "attn_cp", "moe_tp": "moe_tp", "moe_ep": "moe_ep",
            "moe_dp": "moe_dp", "moe": "moe"}
_SIZE = {"attn_tp": "attn_tp_size", "attn_cp": "attn_cp_size", "moe_tp": "moe_tp_size",
         "moe_ep": "ep_size", "moe_dp": "moe_dp_size", "moe": "moe_group_size"}


@pytest.mark.parametrize("lay", ALL_VALID, ids=_id)
def test_groups_partition_ranks_consistently(lay: ParallelLayout):
    tp = lay.tp_size
    for kind in GROUP_KINDS:
        groups = lay.group_members(kind)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(tp)), (kind, groups)  # each rank exactly once
        assert groups == sorted(groups)
        for g in groups:
            assert g == sorted(g)
        size = lay.attn_cp_size if (kind == "moe_dp" and lay.decoupled) else getattr(
            lay, _SIZE[kind])
        assert all(len(g) == size for g in groups), (kind, groups)
        assert len(groups) == tp // size
        for r in range(tp):
            g = lay.group_of(kind, r)
            assert r in g
            c = lay.coords(r)
            if kind == "moe_dp" and lay.decoupled:
                assert g == lay.group_of("attn_cp", r)  # MOE_DP aliases ATTN_CP
                idx = c["attn_cp"]
            else:
                idx = c[_VARYING[kind]]
            assert g.index(r) == idx, (kind, r, g, c)
            # ranks of one group agree on every coordinate that does not vary in it
            for other in g:
                oc = lay.coords(other)
                if kind in ("attn_tp", "attn_cp") or (kind == "moe_dp" and lay.decoupled):
                    fixed = {"attn_tp", "attn_cp"} - {"attn_tp" if kind == "attn_tp"
                                                      else "attn_cp"}
                elif kind == "moe":
                    fixed = {"moe_dp"}
                else:
                    fixed = {"moe_tp", "moe_ep", "moe_dp"} - {kind}
                assert all(oc[f] == c[f] for f in fixed), (kind, r, other)


@pytest.mark.parametrize("lay", ALL_VALID, ids=_id)
def test_group_shapes_follow_reference(lay: ParallelLayout):
    """ATTN_TP / MOE_TP: contiguous blocks; ATTN_CP: stride attn_tp; MOE_EP: stride moe_tp
    inside a block of ep*moe_tp; MOE_DP (coupled): stride ep*moe_tp."""
    tp, atp, mtp, ep = lay.tp_size, lay.attn_tp_size, lay.moe_tp_size, lay.ep_size
    assert lay.group_members("attn_tp") == [list(range(b, b + atp)) for b in range(0, tp, atp)]
    assert lay.group_members("attn_cp") == [list(range(a, tp, atp)) for a in range(atp)]
    assert lay.group_members("moe_tp") == [list(range(b, b + mtp)) for b in range(0, tp, mtp)]
    blk = ep * mtp
    assert lay.group_members("moe_ep") == sorted(
        [list(range(base + t, base + blk, mtp)) for base in range(0, tp, blk) for t in range(mtp)])
    assert lay.group_members("moe") == [list(range(b, b + blk)) for b in range(0, tp, blk)]
    if lay.decoupled:
        assert lay.group_members("moe_dp") == lay.group_members("attn_cp")
    else:
        assert lay.group_members("moe_dp") == [list(range(m, tp, blk)) for m in range(blk)]


@pytest.mark.parametrize("lay", ALL_VALID, ids=_id)
def test_ep_and_moe_tp_groups_tile_the_moe_group(lay: ParallelLayout):
    """Inside each MoE group every EP group meets every MoE-TP group in exactly one rank, so
    one reduction over the MoE group sums each expert shard once (no EP-then-TP pair)."""
    for moe in lay.group_members("moe"):
        eps = [g for g in lay.group_members("moe_ep") if g[0] in moe]
        tps = [g for g in lay.group_members("moe_tp") if g[0] in moe]
        assert all(set(g) <= set(moe) for g in eps + tps)
        assert len(eps) * len(tps) == len(moe)
        for e in eps:
            for t in tps:
                assert len(set(e) & set(t)) == 1, (moe, e, t)
    if lay.moe_dp_size == 1:
        assert lay.group_members("moe") == [list(range(lay.tp_size))]


def test_unknown_group_kind():
    with pytest.raises(ValueError):
        ParallelLayout().group_members("dp")


# ---- summary ----------------------------------------------------------------------------


@pytest.mark.parametrize("lay", [ParallelLayout(),
                                 ParallelLayout(tp_size=4, attn_cp_size=2, ep_size=4),
                                 ParallelLayout(tp_size=8, attn_cp_size=2, moe_dp_size=2)],
                         ids=_id)
def test_summary_json_shape(lay: ParallelLayout):
    s = json.loads(json.dumps(lay.summary()))  # JSON-serialisable as is
    for key, value in (("world_size", lay.tp_size), ("attn_tp_size", lay.attn_tp_size),
                       ("attn_cp_size", lay.attn_cp_size), ("moe_ep_size", lay.ep_size),
                       ("moe_tp_size", lay.moe_tp_size), ("moe_dp_size", lay.moe_dp_size)):
        assert s[key] == value, key
        assert isinstance(s[key], int)
    groups = s["groups"]
    for kind in ("attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp"):
        assert groups[kind] == lay.group_members(kind)
        assert all(isinstance(g, list) and all(isinstance(r, int) for r in g)
                   for g in groups[kind])


def test_summary_example_values():
    s = ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4).summary()
    assert s["world_size"] == 4 and s["attn_tp_size"] == 2 and s["attn_cp_size"] == 2
    assert s["moe_ep_size"] == 4 and s["moe_tp_size"] == 1 and s["moe_dp_size"] == 1
    assert s["groups"]["attn_tp"] == [[0, 1], [2, 3]]
    assert s["groups"]["attn_cp"] == [[0, 2], [1, 3]]
    assert s["groups"]["moe_dp"] == [[0, 2], [1, 3]]
    assert s["groups"]["moe_ep"] == [[0, 1, 2, 3]]
    assert s["groups"]["moe_tp"] == [[0], [1], [2], [3]]
