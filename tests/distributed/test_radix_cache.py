"""The prefix (radix) cache over CP-sharded pages equals running without it (gloo, float32).

On CP layouts of the matrix (a representative set by default, every layout with
CPMOE_FULL=1): requests sharing prefixes aligned and not aligned to pages and
to the CP split, one after another and concurrently, multi-turn (the next prompt extends the
previous prompt and answer), and under memory pressure (entries evicted, requests
preempted) give the same tokens as `--disable-radix-cache`, and every sampled step's logits
within 1e-5; `cached_tokens` is the shared prefix length; a forked prefix's KV stays
sharded: no rank holds more than 1/attn_cp + 5% of it.
"""

from __future__ import annotations


import pytest
import torch

from cpmoe.engine.options import EngineOptions
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout
from tests.distributed._radix_tasks import Turn, engine_task, fork_task
from tests._full import full_matrix
from tests._threads import one_torch_thread
from tests.distributed.test_layouts import MATRIX, TOL, layout_id

# the suite's budget (15 minutes on 2 cores): by default one CP layout of each strategy,
# CP 2 and 4, gather and rank-local MoE; the `full` run (CPMOE_FULL=1) every CP layout
RADIX_LAYOUTS = {"tp2-cp2-dp1-ep1-none-zigzag", "tp4-cp4-dp1-ep4-alltoall-interleave"}
LAYOUTS = [ParallelLayout()] + full_matrix(
    [lay for lay in MATRIX if lay.attn_cp_size > 1], lambda lay: layout_id(lay) in RADIX_LAYOUTS)

PAGE = 4


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=gen).tolist()


PREFIX = tokens(45, 0)  # 45: not a multiple of the page (4) nor of 2 * cp
ALIGNED = PREFIX[:32]  # a multiple of the page and of 2 * cp for cp <= 8


def turns() -> list[Turn]:
    return [Turn(PREFIX + tokens(7, 1)),  # the first: nothing cached
            Turn(PREFIX + tokens(9, 2)),  # shares 45 tokens (not page-aligned)
            Turn(ALIGNED + tokens(5, 3)),  # shares 32 (page-aligned)
            Turn(tokens(6, 4), after=0),  # multi-turn: prompt + answer of turn 0
            Turn(PREFIX + tokens(7, 1))]  # the first prompt again: all but its last token


NEW = 4  # tokens generated per turn
# expected cached_tokens of each turn when the turns run one after another (None: the
# multi-turn one, which shares turn 0's prompt and all but the last token of its answer)
SHARED = [0, 45, 32, None, 51]


def cases(cp: int = 1) -> dict:
    """one_by_one: turns one at a time (steps alike with and without the cache, so the
    logits of every step compare); pressure: all at once (later prompts hit running ones)
    with ~450 tokens of prompts and answers in about 200 slots over all ranks, so entries
    are evicted (and requests may be preempted)."""
    one_by_one = EngineOptions(page_size=PAGE, chunked_prefill_size=16, max_running_requests=1)
    tight = EngineOptions(page_size=PAGE, chunked_prefill_size=8)
    more = turns() + [Turn(tokens(40, 10 + i)) for i in range(2)]
    slots = PAGE * -(-max(36, 200 // cp) // PAGE)
    return {"one_by_one": (turns(), one_by_one, NEW, 4096), "pressure": (more, tight, 8, slots)}


def one_rank(task, *args):
    """A rank task in this process, on one thread as a pool rank has: two OpenMP threads of
    tiny ops on a loaded 2-core machine ran ~100x slower."""
    with one_torch_thread():
        return task(RankInfo(0, 1, torch.device("cpu")), *args)


@pytest.fixture(scope="module")
def reference(qwen3_moe_dir):
    return one_rank(engine_task, ParallelLayout(), qwen3_moe_dir, cases())


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_prefix_cache_gives_the_tokens_and_logits_of_no_cache(layout, pools, qwen3_moe_dir,
                                                              reference):  # noqa: F811
    got = (reference if layout.world_size == 1 else
           pools(layout.world_size).run(engine_task, layout, qwen3_moe_dir,
                                            cases(layout.attn_cp_size))[0])
    one = got["one_by_one"]
    assert one["on"]["tokens"] == one["off"]["tokens"]
    assert one["on"]["tokens"] == reference["one_by_one"]["off"]["tokens"]
    assert len(one["on"]["steps"]) == len(one["off"]["steps"])
    for i, (a, b) in enumerate(zip(one["on"]["steps"], one["off"]["steps"])):
        diff = (a - b).abs().max().item()
        assert diff <= TOL, f"step {i}: logits with the prefix cache differ by {diff:.3e}"
    prompts = one["on"]["prompts"]
    expect = [s if s is not None else len(prompts[0]) + NEW - 1 for s in SHARED]
    assert one["on"]["cached"] == expect
    assert one["off"]["cached"] == [0] * len(SHARED)
    assert one["on"]["pages_left"] == [0] * layout.attn_cp_size
    tight = got["pressure"]
    assert tight["on"]["tokens"] == tight["off"]["tokens"]
    assert tight["on"]["pages_left"] == [0] * layout.attn_cp_size
    assert sum(tight["on"]["cached"]) > 0 and tight["on"]["evictions"] > 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_forked_prefix_matches_prefill_and_stays_sharded(layout, pools,
                                                         qwen3_moe_dir):  # noqa: F811
    first = PREFIX * 2 + tokens(6, 5)  # 96 tokens; the prefix is 94% of it
    second = PREFIX * 2 + tokens(11, 6)
    shared = 2 * len(PREFIX)
    args = (layout, qwen3_moe_dir, first, second, shared)
    got = (one_rank(fork_task, *args) if layout.world_size == 1
           else pools(layout.world_size).run(fork_task, *args))
    got = got if isinstance(got, list) else [got]
    cp = layout.attn_cp_size
    for rank, out in enumerate(got):
        for page_size in (1, 4):
            diff = (out[page_size]["logits"] - out["whole"]).abs().max().item()
            assert diff <= TOL, f"rank {rank}, pages of {page_size}: logits differ by {diff}"
            assert out[page_size]["pages_left"] == [0] * cp
        held = out[1]["prefix_slots"]
        assert sum(held) == shared
        assert max(held) <= shared * (1 / cp + 0.05), (rank, held)
        # pages of 4: at most one partly filled page per rank on top
        assert max(out[4]["prefix_slots"]) <= shared * (1 / cp + 0.05) + PAGE
