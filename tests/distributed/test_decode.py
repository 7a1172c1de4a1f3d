"""Sharded KV cache and seeded sampling across layouts."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cpmoe.engine.sampling import SamplingParams
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout
from tests._quant_bounds import StepRun, decisive_agreement, flip_bound, logit_scale
from tests.conftest import CONFIGS
from tests.distributed._model_tasks import fp8_kv_task, kv_and_sampling_task
from tests.distributed.test_layouts import seqs  # noqa: F401  (fixture)
from tests.e2e._fp8_helpers import with_kv_scales

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
    info = RankInfo(0, 1, torch.device("cpu"))
    return kv_and_sampling_task(info, ParallelLayout(), qwen2_moe_dir, seqs, SAMPLING, 16)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"tp{x.tp_size}-cp{x.attn_cp_size}-"
                         f"dp{x.moe_dp_size}-ep{x.ep_size}-{x.moe_a2a_backend}")
def test_sharded_kv_and_seeded_sampling_match_single_rank(
        layout, pools, qwen2_moe_dir, seqs, single):  # noqa: F811
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


# FP8 flips two runs may differ by: a layout or CPU kernel changes a K/V value by a few
# float32 ulps (AVX2 vs AVX-512 on one rank: 957 of the 16,704 stored values, 3e-8 relative
# on average), which crosses an e4m3 midpoint with probability |difference| / step: 0.006
# flips expected per run pair (CI's AVX-512 machine met one: 7.6e-5 on a layout). A flip
# at the largest value of a write moved the logits by 5.6e-3; two flips at the one-flip
# bound's edge (1.3e-2) each still pass.
FP8_FLIPS = 2
_Q3 = CONFIGS["qwen3_moe"]
KV_ROW = _Q3["num_key_value_heads"] * _Q3["head_dim"]  # the values one token's K (V) row mixes
FLIP_AT = 26  # the K/V write that is altered: layer 1 of the prompts' second chunk


def fp8_bound(reference: dict) -> float:
    return flip_bound(logit_scale(reference["steps"]), FP8_FLIPS, KV_ROW)


def step_run(out: dict) -> StepRun:
    return StepRun(out["steps"], out["rows"], out["tokens"])


@contextlib.contextmanager
def kv_writes_altered(call: int, alter):
    """The `call`-th K/V write of the run (cpmoe.ops.norm.to_kv_cache, 1-based) stores
    alter(codes) instead of the codes."""
    import cpmoe.ops.norm as norm
    real, count = norm.to_kv_cache, [0]

    def store(x, dtype, inv_scale=None):
        count[0] += 1
        y = real(x, dtype, inv_scale)
        return alter(y) if count[0] == call else y

    norm.to_kv_cache = store
    try:
        yield
    finally:
        norm.to_kv_cache = real
    assert count[0] >= call, f"the run made {count[0]} K/V writes, fewer than {call}"


def flip_one_code(y: torch.Tensor) -> torch.Tensor:
    """The largest-magnitude stored value one code away from zero (its neighbouring e4m3
    code: the bit pattern's magnitude + 1 is the next representable value up)."""
    y = y.clone()
    u = y.view(torch.uint8).reshape(-1)
    i = int(y.float().abs().reshape(-1).argmax())
    u[i] = u[i] + 1
    return y


def stale_row(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[0] = y[-1]
    return y


@pytest.fixture(scope="module")
def fp8_single(qwen3_moe_dir, seqs):  # noqa: F811
    return fp8_kv_task(RankInfo(0, 1, torch.device("cpu")), ParallelLayout(), qwen3_moe_dir,
                       seqs, 6, 16)


@pytest.mark.parametrize("layout", FP8_KV_LAYOUTS, ids=lambda x: f"tp{x.tp_size}-cp"
                         f"{x.attn_cp_size}-ep{x.ep_size}-{x.moe_a2a_backend}-{x.cp_strategy}")
def test_fp8_kv_cache_over_cp_shards_matches_single_rank(
        layout, pools, qwen3_moe_dir, seqs, fp8_single):  # noqa: F811
    """--kv-cache-dtype fp8_e4m3 with prompts prefilled in chunks of 16 (the cached prefix
    read from FP8 pages sharded over CP): every sampled step's logits equal one rank's within
    what FP8 flips explain, and the tokens where the reference is decisive are the same
    (tests/_quant_bounds.py derives the bound: float32 rounding that differs by layout or
    CPU kernel can move a K/V value to the next e4m3 code)."""
    out = pools(layout.world_size).run(fp8_kv_task, layout, qwen3_moe_dir, seqs, 6, 16)[0]
    assert len(out["steps"]) == len(fp8_single["steps"]) > 1
    seen = decisive_agreement(step_run(out), step_run(fp8_single), fp8_bound(fp8_single))
    assert seen.rows >= len(seqs) and seen.tokens >= 1, f"compared too little: {seen}"


@pytest.fixture(scope="module")
def scaled_dir(qwen3_moe_dir, tmp_path_factory):  # noqa: F811
    """The Qwen3-MoE checkpoint with per-layer k_scale / v_scale (tests/e2e/_fp8_helpers)."""
    return with_kv_scales(qwen3_moe_dir, tmp_path_factory.mktemp("kv-scales") / "model")


def test_checkpoint_kv_scales_over_cp_shards_match_single_rank(
        pools, scaled_dir, seqs, fp8_single):  # noqa: F811
    """The checkpoint's K/V scales on every rank: FP8 pools sharded over CP (tp2, cp2,
    chunks of 16 read back as cached prefixes) equal one rank on the same checkpoint, within
    what FP8 flips explain; and the scales change the run (scale 1 is another result)."""
    layout = FP8_KV_LAYOUTS[0]
    single = fp8_kv_task(RankInfo(0, 1, torch.device("cpu")), ParallelLayout(), scaled_dir,
                         seqs, 6, 16)
    out = pools(layout.world_size).run(fp8_kv_task, layout, scaled_dir, seqs, 6, 16)[0]
    seen = decisive_agreement(step_run(out), step_run(single), fp8_bound(single))
    assert seen.rows >= len(seqs) and seen.tokens >= 1, f"compared too little: {seen}"
    # the same weights at scale 1 (the checkpoint without its scales): 0.50 apart, 17x the
    # bound, when measured at 2026-12-04
    moved = max((a - b).abs().max().item()
                for a, b in zip(single["steps"], fp8_single["steps"]))
    assert moved > 4 * fp8_bound(single), moved


def test_one_flipped_kv_code_stays_within_the_fp8_bound(
        qwen3_moe_dir, seqs, fp8_single):  # noqa: F811
    """The bound is not too tight: a K/V value moved to its neighbouring e4m3 code (what a
    float32 rounding difference at a midpoint does) in the middle of the run is within it."""
    with kv_writes_altered(FLIP_AT, flip_one_code):
        out = fp8_kv_task(RankInfo(0, 1, torch.device("cpu")), ParallelLayout(),
                          qwen3_moe_dir, seqs, 6, 16)
    seen = decisive_agreement(step_run(out), step_run(fp8_single), fp8_bound(fp8_single))
    assert seen.worst > 0, "the flip changed nothing: it did not reach the cache"


@pytest.mark.parametrize("bug", ["stale-row", "doubled-scale"])
def test_fp8_bound_catches_a_wrong_kv_row_or_scale(
        bug, qwen3_moe_dir, seqs, fp8_single):  # noqa: F811
    """The bound still catches layout bugs: one K/V write with a token's row replaced by
    another token's (a page read from the wrong shard) or with the values doubled (a scale
    applied twice) fails the comparison."""
    alter = {"stale-row": stale_row, "doubled-scale": lambda y: y.float().mul(2).to(y.dtype)}
    with kv_writes_altered(FLIP_AT, alter[bug]):
        out = fp8_kv_task(RankInfo(0, 1, torch.device("cpu")), ParallelLayout(),
                          qwen3_moe_dir, seqs, 6, 16)
    with pytest.raises(AssertionError, match="apart|token"):
        decisive_agreement(step_run(out), step_run(fp8_single), fp8_bound(fp8_single))


def test_sampling_params_validated():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert ProcessGroups.single().world.size == 1
