"""`cpmoe plan`'s per-rank memory: shards built on the meta device, checked against a real
one-rank load and against what EP / attention TP must divide."""

from __future__ import annotations

import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sizing import memory_per_rank
from cpmoe.models.registry import load_model_config
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import ParallelLayout


def test_memory_per_rank_matches_a_loaded_model_and_shrinks_with_the_layout(qwen3_moe_dir):
    cfg, cls = load_model_config(qwen3_moe_dir)
    single = memory_per_rank(cfg, cls, ParallelLayout(), torch.float32)[0]
    runner = ModelRunner(qwen3_moe_dir, ProcessGroups.single(), torch.float32,
                         show_progress=False)
    assert single["weight_bytes"] == runner.weight_bytes()
    assert single["kv_bytes_per_token"] == runner.allocate_kv(4).bytes_per_token()
    # --kv-cache-dtype fp8_e4m3: one byte an element, a quarter of float32's, planned as held
    fp8 = memory_per_rank(cfg, cls, ParallelLayout(), torch.float32, "fp8_e4m3")[0]
    kv = runner.allocate_kv(4, kv_dtype="fp8_e4m3")
    assert kv.k[0].dtype == kv.v[0].dtype == torch.float8_e4m3fn
    assert fp8["kv_bytes_per_token"] == kv.bytes_per_token() == runner.kv_bytes_per_token(
        "fp8_e4m3") == single["kv_bytes_per_token"] // 4
    # what attention reads back is widened to the model's dtype
    kv.k[0].view(-1, *kv.k[0].shape[2:])[1] = 0.3
    k, v = kv.read(0, torch.tensor([1, 2]), torch.float32)
    assert k.dtype == v.dtype == torch.float32 and k[0].eq(0.3125).all() and not v.any()

    # tp4 cp2 ep4: attention TP 2 halves the KV heads; EP 4 keeps a quarter of the experts.
    ranks = memory_per_rank(cfg, cls, ParallelLayout(tp_size=4, attn_cp_size=2, ep_size=4),
                            torch.float32)
    assert len(ranks) == 4
    assert all(r["kv_bytes_per_token"] == single["kv_bytes_per_token"] // 2 for r in ranks)
    experts = sum(p.numel() * 4 for n, p in runner.model.named_parameters() if ".experts." in n)
    for r in ranks:
        assert r["weight_bytes"] < single["weight_bytes"] - experts * 3 // 4 + 1
