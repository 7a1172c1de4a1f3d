"""tests/_quant_bounds.py: the bound is the formula its docstring derives, accepts what FP8
flips can do and rejects what layout bugs do (corrupted inputs fed to it on purpose).

The runs here are synthetic: three sequences of three greedy steps over a vocabulary of 64,
logits of scale ~1 (a little over the tiny test models' 0.6), tokens the argmax of each row.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._quant_bounds import (E4M3_STEP, FP32_TOL, StepRun, decisive_agreement,
                                 flip_bound, logit_scale, rounding_flips)

ROWS = [[0, 1, 2], [0, 1, 2], [0, 1, 2]]


def greedy_run(steps: list[torch.Tensor]) -> StepRun:
    tokens: list[list[int]] = [[] for _ in range(3)]
    for s, rows in zip(steps, ROWS):
        for r, seq in enumerate(rows):
            tokens[seq].append(int(s[r].argmax()))
    return StepRun(steps, ROWS, tokens)


@pytest.fixture
def reference() -> StepRun:
    gen = torch.Generator().manual_seed(3)
    steps = [0.15 * torch.randn(3, 64, generator=gen) for _ in ROWS]
    for s in steps:  # a decisive leader in every row but one
        s[torch.arange(3), torch.arange(3) * 5] += 1.0
    steps[1][2, 11] = steps[1][2].max() + 1e-4  # sequence 2, step 1: a close call
    return greedy_run(steps)


def test_flip_bound_is_the_derived_formula():
    assert flip_bound(0.5, 2, 32) == pytest.approx(FP32_TOL + 2 * 0.5 * 2 ** -3 / math.sqrt(32))
    assert E4M3_STEP == 2 ** -3
    assert flip_bound(0.5, 0, 32) == FP32_TOL  # no flip: the float32 tolerance alone
    with pytest.raises(ValueError, match="mixed >= 1"):
        flip_bound(0.5, 1, 0)


def test_differences_within_the_bound_pass_and_count_what_was_compared(reference):
    bound = flip_bound(logit_scale(reference.steps), 2, 32)
    gen = torch.Generator().manual_seed(4)
    steps = [s + bound * 0.9 * (2 * torch.rand(s.shape, generator=gen) - 1)
             for s in reference.steps]
    got = greedy_run(steps)
    got.tokens = [list(t) for t in reference.tokens]
    seen = decisive_agreement(got, reference, bound)
    assert seen.rows == 9 and seen.tokens == 8 and not seen.cut  # the close call not counted
    assert 0.5 * bound < seen.worst <= bound


def test_a_close_call_may_go_the_other_way_and_ends_that_sequence(reference):
    bound = flip_bound(logit_scale(reference.steps), 2, 32)
    steps = [s.clone() for s in reference.steps]
    steps[2][2] = torch.randn(64)  # after the other token, sequence 2 continues elsewhere
    got = StepRun(steps, ROWS, [list(t) for t in reference.tokens])
    got.tokens[2][1] = int(reference.steps[1][2].topk(2).indices[1])  # the runner-up
    got.tokens[2][2] = 63
    seen = decisive_agreement(got, reference, bound)
    assert seen.cut == {2: 1} and seen.rows == 8


@pytest.mark.parametrize("bug", ["wrong-shard", "missing-scale", "one-row-off", "token"])
def test_layout_bugs_fail_the_comparison(reference, bug):
    """What a wrong shard (another sequence's row), a missing FP8 scale (values 448x), a
    stale row or a decisive token that differs does is caught."""
    bound = flip_bound(logit_scale(reference.steps), 2, 32)
    steps = [s.clone() for s in reference.steps]
    tokens = [list(t) for t in reference.tokens]
    if bug == "wrong-shard":
        steps[0] = steps[0][[1, 0, 2]]
    elif bug == "missing-scale":
        steps[1] = steps[1] * 448
    elif bug == "one-row-off":
        steps[2][0] = reference.steps[1][0]
    else:
        tokens[0][0] = (tokens[0][0] + 1) % 64
    got = StepRun(steps, ROWS, tokens)
    with pytest.raises(AssertionError, match="apart|want"):
        decisive_agreement(got, reference, bound)
    if bug != "token":  # the corruption is far past the bound, not at its edge
        worst = max((g - w).abs().max().item() for g, w in zip(steps, reference.steps))
        assert worst > 5 * bound


def test_runs_with_other_rows_are_refused(reference):
    got = StepRun(reference.steps, [[0, 1, 2], [0, 2, 1], [0, 1, 2]], reference.tokens)
    with pytest.raises(AssertionError, match="different rows"):
        decisive_agreement(got, reference, 1.0)


def test_rounding_flips_accepts_a_neighbour_at_a_midpoint_only():
    """1.0 and 1.125 are neighbouring e4m3 codes (2^-3 apart): 1.0625 is their midpoint.
    A value a hair from it may be stored as either; a value elsewhere, a code two steps off
    or a doubled scale is refused."""
    e4m3 = torch.float8_e4m3fn
    exact = torch.tensor([0.3, -2.7, 1.0625 + 1e-6, 100.0])
    codes = exact.to(e4m3)
    assert rounding_flips(codes, exact, 1e-4) == 0
    flipped = codes.clone()
    flipped[2] = torch.tensor(1.0).to(e4m3)  # the other side of the midpoint
    assert exact[2].to(e4m3).float() == 1.125 and rounding_flips(flipped, exact, 1e-4) == 1
    off = codes.clone()
    off[0] = torch.tensor(0.3 * (1 + 2 ** -2)).to(e4m3)  # two steps away
    with pytest.raises(AssertionError, match="1 of 4 codes"):
        rounding_flips(off, exact, 1e-4)
    with pytest.raises(AssertionError, match="not the rounding"):
        rounding_flips((exact * 2).to(e4m3), exact, 1e-4)
