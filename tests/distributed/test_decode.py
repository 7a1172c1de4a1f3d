"""Sharded KV cache and seeded sampling across layouts."""

from __future__ import annotations

import pytest

from cpmoe.engine.sampling import SamplingParams
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import ParallelLayout
from tests.distributed._model_tasks import fp8_kv_task, kv_and_sampling_task
from tests.distributed.test_layouts import TOL, seqs  # noqa: F401  (fixture)

SAMPLING = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11)
LAYOUTS = [
    ParallelLayout(tp_size=2, attn_cp_size=2, ep_size=2),
    ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4),
    ParallelLayout(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=2),
    ParallelLayout(tp_size=4, attn_cp_size=4, ep_size=4, moe_a2a_backend="alltoall",
                   cp_strategy="interleave"),
    ParallelLayout(tp_size=8, attn_cp_size=8, ep_size=8),
    ParallelLayout(tp_size=8, attn_cp_size=4, ep_size=8, moe_a2a_backend="alltoall"),
]


@pytest.fixture(scope="module")
def single(qwen2_moe_dir, seqs):  # noqa: F811
    from concurrent.futures import ThreadPoolExecutor  # noqa: F401  (keeps import local)
    from cpmoe.parallel.launch import RankInfo
    import torch
    info = RankInfo(0, 1, torch.device("cpu"))
    return kv_and_sampling_task(info, ParallelLayout(), qwen2_moe_dir, seqs, SAMPLING, 16)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x.tp_size}-cp{x.attn_cp_size}-"
                         f"dp{x.moe_dp_size}-ep{x.ep_size}-{x.moe_a2a_backend}")
def test_sharded_kv_and_seeded_sampling_match_single_rank(layout, pools, qwen2_moe_dir, seqs,
                                                          single):  # noqa: F811
    out = pools(layout.world_size).run(kv_and_sampling_task, layout, qwen2_moe_dir, seqs,
                                       SAMPLING, 16)
    bound = single["kv_bytes"] * (1 / layout.attn_cp_size + 0.05)
    for rank, r in enumerate(out):
        assert r["kv_bytes"] <= bound, (f"rank {rank} holds {r['kv_bytes']} KV bytes, more "
                                        f"than 1/{layout.attn_cp_size} + 5% of "
                                        f"{single['kv_bytes']}")
        assert r["tokens"] == single["tokens"], f"rank {rank}: sampled tokens differ"
        assert r["kv_used_after"] == 0, "KV slots leaked after generation"
    assert single["tokens"] != [t[:1] * len(t) for t in single["tokens"]]  # really sampled


FP8_KV_LAYOUTS = [ParallelLayout(tp_size=2, attn_cp_size=2, ep_size=2),
                  ParallelLayout(tp_size=4, attn_cp_size=4, ep_size=4, moe_a2a_backend="alltoall",
                                 cp_strategy="interleave")]


@pytest.fixture(scope="module")
def fp8_single(qwen3_moe_dir, seqs):  # noqa: F811
    import torch
    from cpmoe.parallel.launch import RankInfo
    return fp8_kv_task(RankInfo(0, 1, torch.device("cpu")), ParallelLayout(), qwen3_moe_dir,
                       seqs, 6, 16)


@pytest.mark.parametrize("layout", FP8_KV_LAYOUTS, ids=lambda x: f"tp{x.tp_size}-cp"
                         f"{x.attn_cp_size}-ep{x.ep_size}-{x.moe_a2a_backend}-{x.cp_strategy}")
def test_fp8_kv_cache_over_cp_shards_matches_single_rank(layout, pools, qwen3_moe_dir, seqs,
                                                         fp8_single):  # noqa: F811
    """--kv-cache-dtype fp8_e4m3 with prompts prefilled in chunks of 16 (the cached prefix
    read from FP8 pages sharded over CP): every sampled step's logits equal one rank's."""
    import torch
    out = pools(layout.world_size).run(fp8_kv_task, layout, qwen3_moe_dir, seqs, 6, 16)[0]
    assert out["tokens"] == fp8_single["tokens"]
    assert len(out["steps"]) == len(fp8_single["steps"]) > 1
    for got, want in zip(out["steps"], fp8_single["steps"]):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_sampling_params_validated():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert ProcessGroups.single().world.size == 1
