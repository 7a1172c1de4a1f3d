"""Sharded KV cache and seeded sampling across layouts."""

from __future__ import annotations

import pytest

from cpmoe.engine.sampling import SamplingParams
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import ParallelLayout
from tests.distributed._model_tasks import kv_and_sampling_task
from tests.distributed.test_layouts import seqs  # noqa: F401  (fixture)

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


def test_sampling_params_validated():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert ProcessGroups.single().world.size == 1
