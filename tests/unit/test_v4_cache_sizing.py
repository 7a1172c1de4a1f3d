"""DeepSeek-V4's cache sized like Qwen's and its limits known before admission.

- `cache_bytes` is what a `V4Cache` of those sizes allocates (every ring, entry pool and
  page table, summed from the tensors themselves), over capacities, slot counts and CP
  sizes;
- `tokens_for_bytes` (what --mem-fraction-static leaves, through the model's
  `cache_tokens_for_bytes` hook) is the largest capacity that fits: a cache one token
  larger does not; a budget below the rings of the slots alone gives 0;
- the scheduler admits at most the cache's sequence slots, whatever
  --max-running-requests says: five prompts through a cache of two slots give each prompt's
  own tokens (without the cap the third admission met "all 2 sequence slots are in use"
  mid-run);
- a request that can never fit the cache is refused before any step, in one line.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.cp.kv_cache import CacheFullError
from cpmoe.engine.options import EngineOptions
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4.cache import V4Cache, cache_bytes, tokens_for_bytes
from cpmoe.models.deepseek_v4.config import parse_deepseek_v4
from cpmoe.parallel.groups import ProcessGroups
from tests._v4_tiny import tiny_v4

CFG = parse_deepseek_v4(tiny_v4(hc_mult=2))


def allocated(kv: V4Cache) -> int:
    tensors = list(kv.page_table.values())
    for lc in kv.layers:
        tensors.append(lc.window)
        for pool in (lc.comp, lc.index):
            if pool is not None:
                tensors += [pool.rows, pool.entries]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("capacity, seqs, cp", [(300, 4, 1), (1000, 3, 2), (64, 256, 4),
                                                (5000, 17, 8), (129, 1, 2)])
def test_cache_bytes_is_what_the_cache_allocates(capacity, seqs, cp):
    for rank in {0, cp - 1}:
        kv = V4Cache(CFG, capacity, torch.float32, torch.device("cpu"), (rank, cp), seqs)
        assert cache_bytes(CFG, capacity, kv.max_seqs, cp, 4) == allocated(kv)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner.from_config(tiny_v4(hc_mult=2), ProcessGroups.single("cpu"),
                                   torch.float32, seed=0)


@pytest.mark.parametrize("budget_mib, seqs", [(4, 8), (9, 3), (40, 64)])
def test_tokens_for_bytes_is_the_largest_cache_that_fits(runner, budget_mib, seqs):
    budget = budget_mib << 20
    tokens = runner.model.cache_tokens_for_bytes(budget, seqs)
    assert tokens > 0
    runner.allocate_kv(tokens, max_seqs=seqs)
    assert runner.kv.capacity == tokens and runner.kv.max_seqs == seqs
    assert allocated(runner.kv) <= budget
    bigger = V4Cache(CFG, tokens + 1, torch.float32, torch.device("cpu"), (0, 1), seqs)
    assert allocated(bigger) > budget


def test_a_budget_below_the_slot_rings_gives_no_tokens():
    rings = cache_bytes(CFG, 1, 256, 1, 2)
    assert tokens_for_bytes(CFG, rings - 1, 256, 1, 2) == 0
    assert tokens_for_bytes(CFG, rings, 256, 1, 2) >= 1


def test_admission_stops_at_the_cache_slots(runner):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 7, 90, 3, 21)]
    alone = []
    for p in prompts:
        runner.kv = None
        alone.append(generate(runner, [p], 6)[0])
    runner.allocate_kv(2000, max_seqs=2)
    got = generate(runner, prompts, 6, options=EngineOptions(max_running_requests=8,
                                                             chunked_prefill_size=32))
    assert got == alone


def test_a_request_that_cannot_fit_is_refused_in_one_line(runner):
    runner.allocate_kv(100, max_seqs=4)
    with pytest.raises(CacheFullError, match=r"prompt 1: a prompt of 90 tokens with 20 new "
                                             r"tokens needs 109 KV slots") as err:
        generate(runner, [[1] * 10, [2] * 90], 20)
    assert "\n" not in str(err.value)
