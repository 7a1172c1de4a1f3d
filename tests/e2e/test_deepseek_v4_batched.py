"""DeepSeek-V4 batched prefill: the result does not depend on how rows are grouped.

One rank, float32, the tiny V4 checkpoint of the HF parity tests:
- a batch of sequences (1, 7, 130, 600 tokens) gives each sequence's logits as its own
  prefill does (within 1e-5): no state leaks between sequences sharing a block, and
  indexer picks do not depend on the batch (fp64 scores; each row's top-k taken over its own
  sequence's entries, as the reference takes it, ties included);
- row blocks forced small (a budget of a few rows, blocks spanning sequence boundaries)
  give the same logits as one block.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4 import prefill
from cpmoe.parallel.groups import ProcessGroups
from tests.distributed._v4_tasks import make_v4_model

LENGTHS = [1, 7, 130, 600]
TOL = 1e-5


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    d = make_v4_model("base", tmp_path_factory.mktemp("v4_batched"))[1]
    yield ModelRunner(d, ProcessGroups.single(), torch.float32, show_progress=False)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def seqs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


def test_v4_batched_prefill_matches_each_sequence_alone(runner, seqs):
    batched = runner.prefill(seqs).split(LENGTHS)
    for seq, got in zip(seqs, batched):
        diff = (got - runner.prefill([seq])).abs().max().item()
        assert diff <= TOL, f"length {len(seq)}: batched vs alone {diff:.3e}"


def test_v4_small_row_blocks_match_one_block(runner, seqs, monkeypatch):
    one_block = runner.prefill(seqs)
    # per row max(40 keys x (4 heads + 32), 2 index heads x 183 entries) = 1,440 elements:
    # 45-row blocks, 17 of them over the 738 rows
    monkeypatch.setattr(prefill, "_BLOCK_ELEMS", 1 << 16)
    plan_blocks = []
    build = prefill.PrefillPlan.build

    def spy(*args, **kwargs):
        plan = build(*args, **kwargs)
        plan_blocks.append(plan.blocks)
        return plan

    monkeypatch.setattr(prefill.PrefillPlan, "build", spy)
    blocked = runner.prefill(seqs)
    assert len(plan_blocks[0]) > 10 and any(s1 - s0 > 1 for _, _, s0, s1 in plan_blocks[0])
    diff = (blocked - one_block).abs().max().item()
    assert diff <= TOL, f"small blocks vs one block {diff:.3e}"
