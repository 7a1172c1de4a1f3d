"""DeepSeek-V4 chunked prefill (extend after a cached prefix) equals whole prefill (gloo,
float32), on one rank and on the V4 layouts of test_deepseek_v4_cp's matrix.

Prompts of 300, 120, 1 and 7 tokens (the CP tests' fixture: CSA entries past the indexer's
top-k, HCA entries, ranks without tokens) are prefilled 16, 64 and 257 tokens at a time,
every prompt's next chunk in one extend step: the logits of every prompt position and
16 greedy decode steps after it must be those of the one-rank whole prefill (1e-4; one
rank: 1e-5), the greedy tokens the same. Chunk 16 and 64 cross the sliding window (8),
the CSA rate (4, overlapping windows open across a chunk edge) and the HCA rate (128) at
many offsets; 257 puts one chunk edge inside an HCA window and leaves 43 tokens after it.

The fixture's indexer has 2 heads: most top-k picks past 32 entries are among exactly tied
scores, which `torch.topk` resolves by the whole row, its length included. A chunk's query
therefore ranks over its whole prompt's entries (`Segment.end`), as the whole prefill's
query does: the control shows that ranking over the entries so far instead gives other
picks and other logits.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import ParallelLayout
from tests._full import full_matrix
from tests.distributed._v4_tasks import chunked_run, chunked_task, greedy_run, make_v4_model
from tests.distributed.test_deepseek_v4_cp import (LENGTHS, MATRIX, NEW_TOKENS, V4_DEFAULT,
                                                   layout_id, random_ids)

CHUNKS = [16, 64, 257]
TOL = 1e-4  # CP layouts vs one rank's whole prefill
ONE_RANK_TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_v4_model("base", tmp_path_factory.mktemp("v4_chunked"))[1]


@pytest.fixture(scope="module")
def seqs() -> list[list[int]]:
    return random_ids(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def whole(model_dir, seqs) -> dict:
    return greedy_run(ProcessGroups.single(), model_dir, seqs, NEW_TOKENS)


def assert_like_whole(got: dict, want: dict, tol: float, what: str) -> None:
    diff = (got["prefill"] - want["prefill"]).abs().amax(-1)
    bad = (diff > tol).nonzero().flatten().tolist()
    assert not bad, (f"{what}: prefill logits of {len(bad)} rows differ from the whole "
                     f"prefill (first row {bad[0]}, by {diff.max().item():.3e})")
    for i, (a, b) in enumerate(zip(got["steps"], want["steps"])):
        d = (a - b).abs().max().item()
        assert d <= tol, f"{what}: decode step {i} logits differ by {d:.3e}"
    assert got["tokens"] == want["tokens"], f"{what}: greedy tokens differ"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_one_rank_chunked_prefill_equals_whole(chunk, model_dir, seqs, whole):
    got = chunked_run(ProcessGroups.single(), model_dir, seqs, chunk, NEW_TOKENS)
    assert_like_whole(got, whole, ONE_RANK_TOL, f"chunk {chunk}")


def test_chunk_ranking_over_entries_so_far_would_differ(model_dir, seqs, whole):
    """The control: the first 257-token chunk of the 300-token prompt, its indexer rows
    only as long as the chunk's entries (no `end`), picks other tied entries."""
    runner = ModelRunner(model_dir, ProcessGroups.single(), torch.float32,
                         show_progress=False)
    runner.allocate_kv(400)
    short = runner.extend([Segment(0, seqs[0][:257])], last_only=False)
    diff = (short - whole["prefill"][:257]).abs().max().item()
    assert diff > 1e-2, f"ranking over the chunk's entries alone changed nothing ({diff:.1e})"


@pytest.mark.parametrize("layout", full_matrix(MATRIX, lambda x: x in V4_DEFAULT),
                         ids=layout_id)
def test_v4_layout_chunked_prefill_equals_whole(layout, pools, model_dir, seqs, whole):
    got = pools(layout.world_size).run(chunked_task, layout, model_dir, seqs, CHUNKS,
                                       NEW_TOKENS)[0]
    for chunk in CHUNKS:
        assert_like_whole(got[chunk], whole, TOL, f"{layout_id(layout)} chunk {chunk}")


def test_a_one_token_chunk_alone_leaves_a_cp_rank_without_rows_and_equals_whole(
        pools, model_dir, seqs, whole):
    """Chunks of 299: the second step extends only the 300-token prompt's last token, so one
    of 2 CP ranks has no row of the step (a served run of mixed prompts met this: the
    output projection's view of 0 rows raised on that rank)."""
    layout = ParallelLayout(tp_size=2, attn_cp_size=2, moe_dp_size=1, ep_size=2)
    got = pools(layout.world_size).run(chunked_task, layout, model_dir, seqs, [299],
                                       NEW_TOKENS)[0]
    assert_like_whole(got[299], whole, TOL, "tp2-cp2 chunk 299")
