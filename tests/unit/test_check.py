"""`cpmoe check`: routing margins, the verdict, and what the command prints.

Margins are checked on routers whose logits are written out by hand; the verdict on logits
built so the answer is known. What the command prints (progress, margins and decode steps
per prompt) is read from test_cli's tp4 cp2 ep4 `cpmoe check` run
(test_check_reports_progress_decode_and_routing_margins_per_prompt), which that module runs
anyway: no run of its own here. The model runs here (one rank, in this process) check that
both of check's runs use the --kv-cache-dtype they are given, and that rank 0 frees the
layout before it builds the reference.
"""

from __future__ import annotations

import torch

from cpmoe.check import CheckReport, IndexerMargins, RoutingMargins, _compare
from cpmoe.models.deepseek_v4.indexer import ReferenceTopK
from cpmoe.moe.router import SoftmaxTopKRouter


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(4, 4, 2, True, torch.float32)
        self.gate.weight.copy_(torch.eye(4))  # router logits = the row itself


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])


def test_routing_margin_is_the_gap_at_the_top_k_cut_per_prompt():
    model = _Model()
    margins = RoutingMargins(model, near_tie=1e-4)
    assert margins.routers == 2
    # top-2 of 4: the margin is 2nd largest minus 3rd largest
    rows = torch.tensor([[3.0, 2.0, 1.0, 0.0],      # prompt 0, position 0: margin 1
                         [2.0, 1.0, 1.0 + 1e-6, 0.0],  # prompt 0, position 1: 1e-6, a tie
                         [5.0, 0.0, 4.5, 4.0]])     # prompt 1, position 0: margin 0.5
    margins.name_rows([(0, 0), (0, 1), (1, 0)])
    model.layers[0].gate(rows)
    second = rows.clone()
    second[2] = torch.tensor([5.0, 0.0, 4.25, 4.0])  # prompt 1: margin 0.25 in layer 1
    model.layers[1].gate(second)
    margins.name_rows(None)
    model.layers[1].gate(torch.tensor([[1.0, 1.0, 1.0, 1.0]]))  # unnamed rows: not recorded
    m0, layer0, pos0, tie0 = margins.best[0]
    assert abs(m0 - 1e-6) < 1e-7 and (layer0, pos0, tie0) == (0, 1, True)
    m1, layer1, pos1, tie1 = margins.best[1]
    assert abs(m1 - 0.25) < 1e-6 and (layer1, pos1, tie1) == (1, 0, False)


class _IndexerLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pick = ReferenceTopK()


def test_indexer_margin_is_the_gap_at_each_rows_top_k_cut():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_IndexerLayer(), _IndexerLayer()])
    margins = IndexerMargins(model, near_tie=1e-4)
    assert margins.modules == 2
    inf = float("inf")
    # top-2 of each row's entries [first, first + length); -inf: not visible
    scores = torch.tensor([
        [3.0, 2.0, 1.0, 0.5, 9.0],      # row 0: entries 0-3: margin 2 - 1 = 1
        [9.0, 3.0, 2.0, 2.0 - 1e-6, 0.0],  # row 1: entries 1-4: 1e-6, a near-tie
        [0.0, 0.0, 0.0, -1.0, 5.0],     # row 2: entries 0-3: tied zeros at the cut: none
        [4.0, 3.0, -inf, -inf, -inf],   # row 3: two visible of five: no cut
        [4.0, 3.0, 1.0, 7.0, 7.0]])     # row 4: entries 0-1, length 2 = k: no cut
    first = torch.tensor([0, 1, 0, 0, 0])
    length = torch.tensor([4, 4, 4, 5, 2])
    rows = torch.tensor([0, 1, 2, 3, 4])
    margins.name_rows([(0, 10), (0, 11), (1, 12), (2, 13), (3, 14)])
    picks = model.layers[1].pick(scores, first, length, 2, rows)
    assert picks[0].tolist() == [0, 1] and picks[3].tolist() == [0, 1]
    # a block of the same forward: only its rows' names count (row 2 -> prompt 1)
    model.layers[0].pick(torch.tensor([[5.0, 4.5, 4.25]]), torch.tensor([0]),
                         torch.tensor([3]), 2, torch.tensor([2]))
    margins.name_rows(None)
    model.layers[0].pick(scores, first, length, 2, rows)  # unnamed: not recorded
    m0, layer0, pos0, tie0 = margins.best[0]
    assert abs(m0 - 1e-6) < 2e-7 and (layer0, pos0, tie0) == (1, 11, True)
    m1, layer1, pos1, tie1 = margins.best[1]
    assert abs(m1 - 0.25) < 1e-6 and (layer1, pos1, tie1) == (0, 12, False)
    assert margins.best[2][0] == inf and margins.best[3][0] == inf
    assert not margins.best[2][3] and not margins.best[3][3]


def _report_for(got_last: list[float], want_last: list[float], tie: bool) -> CheckReport:
    """One one-token prompt; reference logits want_last, layout logits got_last."""
    class _Margins:
        routers = 1
        best = {0: [1e-6 if tie else 1.0, 0, 0, tie]}
    report = CheckReport(decode_steps=1, near_tie=1e-4)
    got, want = torch.tensor([got_last]), torch.tensor([want_last])
    _compare(report, [[7]], got, want, [got], [want], _Margins(), None, 0)
    return report


def test_a_mismatch_fails_the_check_and_a_routing_tie_excuses_none():
    same = _report_for([0.0, 2.0, 1.0], [0.0, 2.0, 1.0], tie=False)
    assert same.matches == 1 and same.failures() == [] and same.max_abs_diff == 0.0
    flipped = _report_for([0.0, 1.0, 2.0], [0.0, 2.0, 1.0], tie=False)
    p = flipped.prompts[0]
    assert not p.first_token_match and p.decode_top1_mismatches == 1
    assert flipped.failures() == [0] and flipped.max_abs_diff == 1.0
    tied = _report_for([0.0, 1.0, 2.0], [0.0, 2.0, 1.0], tie=True)
    assert tied.prompts[0].near_tie and tied.failures() == [0]


def test_decode_top1_differences_fail_in_float32_only():
    report = _report_for([0.0, 2.0, 1.0], [0.0, 2.0, 1.0], tie=False)
    report.prompts[0].decode_top1_mismatches = 2
    assert report.failures() == [0]
    report.strict_decode = False  # 16-bit: reported, not failed
    assert report.failures() == []


def test_check_runs_over_the_kv_cache_dtype_it_is_given(qwen3_moe_dir):
    """`cpmoe check --kv-cache-dtype fp8_e4m3` compares both runs over FP8 pools: `_run`
    builds its cache in the dtype it is handed (the logits move by the rounding), and the
    result equals generate's own path over FP8 pools, the prefill's last position."""
    from cpmoe.check import _run
    from cpmoe.engine.options import EngineOptions
    from cpmoe.engine.generate import generate
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups

    runner = ModelRunner(qwen3_moe_dir, ProcessGroups.single(), torch.float32,
                         show_progress=False)
    seqs, feeds = [[5, 9, 2, 77, 31, 8, 140]], [[3, 4]]
    fp8, fp8_steps = _run(runner, seqs, feeds, "fp8_e4m3")
    plain, _ = _run(runner, seqs, feeds, "auto")
    assert (fp8 - plain).abs().max() > 1e-4
    steps: list[torch.Tensor] = []
    generate(runner, seqs, 1, observe=steps.append,
             options=EngineOptions(kv_cache_dtype="fp8_e4m3"))
    torch.testing.assert_close(fp8[-1:], steps[0], rtol=1e-6, atol=1e-6)
    assert len(fp8_steps) == 2


def test_the_layout_is_freed_before_the_reference_is_built(qwen3_moe_dir, monkeypatch):
    """Rank 0 never holds two models: the layout's runner is gone (its outputs on the host)
    when the reference is built, and the comparison of one model with itself is exact."""
    import gc
    import weakref

    import cpmoe.check as check
    from cpmoe.engine.rank_tasks import RunSpec
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups
    from cpmoe.parallel.launch import RankInfo
    from cpmoe.parallel.layout import ParallelLayout

    layouts: list[weakref.ref] = []

    def build_layout(info, spec):
        runner = ModelRunner(spec.model_dir, ProcessGroups.single(), spec.dtype,
                             show_progress=False)
        layouts.append(weakref.ref(runner))
        return runner

    class Reference(ModelRunner):
        def __init__(self, *args, **kwargs):
            gc.collect()
            assert layouts and layouts[0]() is None, "the layout's runner is still alive"
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(check, "build_runner", build_layout)
    monkeypatch.setattr(check, "ModelRunner", Reference)
    spec = RunSpec(qwen3_moe_dir, ParallelLayout(), torch.float32, progress=False)
    batches = [[[5, 9, 2, 77, 31, 8, 140]], [[4, 4, 81, 3], [17, 2, 9, 60, 12]]]
    report = check.check_task(RankInfo(0, 1, torch.device("cpu")), spec, batches, 2, 0, None)
    assert len(report.prompts) == 3 and report.failures() == []
    assert all(p.max_abs_diff == 0 and p.decode_max_abs_diff == 0 for p in report.prompts)
