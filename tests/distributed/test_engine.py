"""The engine over sharded pages, on CP layouts against one rank (gloo, float32): chunked
prefill equals one-shot prefill, preemption under memory pressure changes no token, and
decoding streams get a token in every step while a long prompt is prefilled in chunks."""

from __future__ import annotations

import pytest
import torch

from cpmoe.engine.sampling import SamplingParams
from cpmoe.parallel.layout import ParallelLayout
from tests.distributed._engine_tasks import chunked_prefill_task, preemption_task, streaming_task
from tests._full import full_matrix
from tests.distributed.test_layouts import MATRIX, TOL, layout_id

CHUNKS = [7, 64, 1000]
LENGTHS = [150, 1, 9, 70]
# every CP layout of the matrix at 2 and 4 ranks, and the 8-rank ones of each CP width
CP_LAYOUTS = [lay for lay in MATRIX if lay.attn_cp_size > 1 and (
    lay.tp_size < 8 or layout_id(lay) in {"tp8-cp2-dp1-ep8-none-zigzag",
                                          "tp8-cp4-dp1-ep8-none-interleave",
                                          "tp8-cp8-dp1-ep8-alltoall-zigzag"})]
# The default run (2-core budget) keeps one layout of each kind: both CP strategies, CP 2 and
# 4, world sizes 2 / 4 / 8, and each MoE layout (MoE-TP, EP, EP x MoE-TP, alltoall,
# alltoall_padded, coupled MoE-DP 2 and 4). The other CP layouts run with CPMOE_FULL=1.
CHUNKED_DEFAULT = {"tp2-cp2-dp1-ep1-none-zigzag", "tp2-cp2-dp1-ep2-none-interleave",
                   "tp4-cp2-dp1-ep2-none-zigzag", "tp4-cp2-dp1-ep4-alltoall_padded-interleave",
                   "tp4-cp2-dp2-ep2-none-interleave", "tp4-cp4-dp1-ep4-alltoall-zigzag",
                   "tp4-cp4-dp4-ep1-none-interleave", "tp8-cp4-dp1-ep8-none-interleave"}


@pytest.fixture(scope="module")
def long_seqs() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def one_shot(qwen3_moe_dir, long_seqs):
    from cpmoe.parallel.launch import RankInfo
    return chunked_prefill_task(RankInfo(0, 1, torch.device("cpu")), ParallelLayout(),
                                qwen3_moe_dir, long_seqs, [])["whole"]


def test_chunked_default_layouts_cover_every_kind():
    kept = [lay for lay in CP_LAYOUTS if layout_id(lay) in CHUNKED_DEFAULT]
    assert len(kept) == len(CHUNKED_DEFAULT)  # each name is a layout of CP_LAYOUTS
    assert {lay.cp_strategy for lay in kept} == {"zigzag", "interleave"}
    assert {lay.tp_size for lay in kept} == {2, 4, 8}
    assert {lay.attn_cp_size for lay in kept} == {2, 4}
    assert {lay.moe_a2a_backend for lay in kept} == {"none", "alltoall", "alltoall_padded"}
    kinds = {(lay.ep_size > 1, lay.moe_tp_size > 1, lay.moe_dp_size > 1) for lay in kept}
    assert {(False, True, False), (True, False, False), (True, True, False),
            (False, False, True), (True, False, True)} <= kinds


@pytest.mark.parametrize("layout", full_matrix(
    CP_LAYOUTS, lambda lay: layout_id(lay) in CHUNKED_DEFAULT), ids=layout_id)
def test_chunked_prefill_over_sharded_kv_matches_one_shot(layout, pools, qwen3_moe_dir,
                                                          long_seqs, one_shot):
    got = pools(layout.world_size).run(chunked_prefill_task, layout, qwen3_moe_dir, long_seqs,
                                       CHUNKS)
    total = sum(LENGTHS)
    for rank, out in enumerate(got):
        bound = total * out["kv_bytes_per_token"] * (1 / layout.attn_cp_size + 0.05)
        for chunk in CHUNKS:
            diff = (out["chunked"][chunk] - one_shot).abs().max().item()
            assert diff <= TOL, f"rank {rank}, chunks of {chunk}: logits differ by {diff:.3e}"
            assert out["kv_bytes"][chunk] <= bound, (
                f"rank {rank}, chunks of {chunk}: {out['kv_bytes'][chunk]} KV bytes, more "
                f"than 1/{layout.attn_cp_size} + 5% of the sequence's")


# By default one rank and CP 2 under each strategy: zigzag with EP, interleave with MoE-TP
# (preemption is the scheduler's and the CP ranks' KV pages; the cache is split by CP alone,
# 96 // cp slots per rank). The demo layout tp4-cp2-ep4 (the same CP 2 and zigzag, under
# attention TP 2 and EP 4: 11 s of 4 ranks on 2 cores) runs in `full`.
PRESSURE = [ParallelLayout(), ParallelLayout(tp_size=2, attn_cp_size=2, ep_size=2),
            ParallelLayout(tp_size=2, attn_cp_size=2, cp_strategy="interleave")] + full_matrix(
    [ParallelLayout(tp_size=4, attn_cp_size=2, ep_size=4)], lambda lay: False)


@pytest.mark.parametrize("layout", PRESSURE, ids=layout_id)
def test_preemption_under_memory_pressure_changes_no_token(layout, pools, qwen3_moe_dir,
                                                           long_seqs):
    seqs = [s[:40] for s in long_seqs] + [long_seqs[0][60:100]]
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=5)
    free = pools(layout.world_size).run(preemption_task, layout, qwen3_moe_dir, seqs, 12,
                                        sampling, None)[0]
    # 96 slots in all, split over the CP ranks: room for about two of the five requests
    per_rank = 96 // layout.attn_cp_size
    tight = pools(layout.world_size).run(preemption_task, layout, qwen3_moe_dir, seqs, 12,
                                         sampling, per_rank)[0]
    assert tight["preemptions"] > 0, "the cache was not tight enough to preempt"
    assert tight["tokens"] == free["tokens"]
    assert tight["kv_used_after"] == 0


def test_decoding_streams_get_a_token_every_step_while_a_long_prompt_prefills(
        pools, qwen3_moe_dir, long_seqs):
    layout = ParallelLayout(tp_size=2, attn_cp_size=2, ep_size=2)
    short = [s[:5] for s in long_seqs[:3]]
    steps = pools(2).run(streaming_task, layout, qwen3_moe_dir, short, long_seqs[0], 16)[0]
    prefill_steps = [s for s in steps[2:] if s["prefill_tokens"]]
    assert len(prefill_steps) >= 9  # 150 tokens in chunks of 16
    for s in prefill_steps:
        assert set(s["rids"]) >= {0, 1, 2}, f"a stream stalled during a prefill chunk: {s}"
