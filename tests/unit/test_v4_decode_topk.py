"""DeepSeek-V4's 16-bit decode top-k (and the torch fallback of the prefill indexer) pick
without sorting what a stable descending sort picks, ties to the lower entry.

The reference is the rule written out: a stable `torch.sort` of every entry's score
(entry order, -inf where not valid) over all CP ranks' shards put back in entry order, its
first k, -1 where the score is -inf. Scores are drawn from a few values (0.0 and -0.0
among them, as relu sums give) so most picks at the cut are among exact ties. The
per-rank candidates (`local_candidates`) and their merge (`top_keys` of the union, what
the all-gather feeds) run here for every rank of 1, 2, 3 and 8 without processes; a decode
step and a prefill of a tiny V4 in bfloat16 on CPU then run with torch.sort and argsort
made to raise.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4 import model as v4_model
from cpmoe.models.deepseek_v4.decode import local_candidates
from cpmoe.models.deepseek_v4.indexer import keys_to_ids, order_keys, top_keys
from cpmoe.parallel.groups import ProcessGroups
from tests._v4_tiny import tiny_v4


def tied_scores(B: int, C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, -0.0, 0.5, 1.25, -2.0, 3.0, 1e-30])
    scores = values[torch.randint(0, len(values), (B, C), generator=gen)]
    valid = torch.rand(B, C, generator=gen) < 0.8
    return scores, valid


def sorted_reference(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    s = scores.masked_fill(~valid, float("-inf"))
    if s.shape[1] < k:
        s = torch.nn.functional.pad(s, (0, k - s.shape[1]), value=float("-inf"))
    best = s.sort(dim=-1, descending=True, stable=True)
    return torch.where(best.values[:, :k] > float("-inf"), best.indices[:, :k], -1)


@pytest.mark.parametrize("cp", [1, 2, 3, 8])
@pytest.mark.parametrize("entries, k", [(200, 32), (40, 32), (5, 16), (1, 4)])
def test_merged_rank_topks_pick_what_a_stable_sort_picks(cp, entries, k):
    scores, valid = tied_scores(6, entries, seed=cp * 1000 + entries)
    want = sorted_reference(scores, valid, k)
    # rank r holds entries r, r + cp, ...: its local column j is entry j * cp + r
    parts = [local_candidates(scores[:, r::cp], valid[:, r::cp], k, r, cp) for r in range(cp)]
    got = keys_to_ids(top_keys(torch.cat(parts, dim=1), k)) if cp > 1 else keys_to_ids(parts[0])
    assert torch.equal(got, want)


def test_order_keys_treat_minus_zero_as_zero_and_order_by_id():
    scores = torch.tensor([[0.0, -0.0, -0.0, 0.0, 1.0, float("-inf")]])
    ids = torch.arange(6)[None]
    picks = keys_to_ids(order_keys(scores, ids).topk(6, dim=-1).values)
    assert picks.tolist() == [[4, 0, 1, 2, 3, -1]]


class _NoSorts(TorchFunctionMode):
    SORTS = {torch.sort, torch.argsort, torch.Tensor.sort, torch.Tensor.argsort}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SORTS:
            raise AssertionError(f"{func.__name__} in V4 attention")
        return func(*args, **(kwargs or {}))


def _no_sorts(monkeypatch) -> list[str]:
    """Both attention paths of the decoder layer run under `_NoSorts` -> the paths run."""
    ran: list[str] = []
    for name in ("decode_attention", "prefill_attention"):
        real = getattr(v4_model, name)

        def checked(*a, _real=real, _name=name, **k):
            ran.append(_name)
            with _NoSorts():
                return _real(*a, **k)
        monkeypatch.setattr(v4_model, name, checked)
    return ran


def test_bf16_decode_and_prefill_run_without_sorts(monkeypatch):
    """CPU bfloat16 takes the 16-bit decode top-k (`_global_topk`) and the prefill
    indexer's torch fallback; 150 tokens give 37 CSA entries, past the top-k of 16."""
    runner = ModelRunner.from_config(tiny_v4(hc_mult=2), ProcessGroups.single("cpu"),
                                     torch.bfloat16, seed=0)
    runner.allocate_kv(400)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (150, 9)]
    ran = _no_sorts(monkeypatch)
    first = runner.prefill(seqs, [0, 1], last_only=True).argmax(-1).tolist()
    steps = [runner.decode([0, 1], first)]
    steps.append(runner.decode([0, 1], steps[-1].argmax(-1).tolist()))
    assert all(torch.isfinite(s).all() for s in steps)
    assert {"decode_attention", "prefill_attention"} <= set(ran)
