"""Rank tasks for the layout tests (module-level, so spawned ranks can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


def run_model(groups: ProcessGroups, model_dir: Path, seqs: list[list[int]],
              new_tokens: int) -> dict:
    """Prefill logits (all positions), collective counts of that prefill, greedy tokens and
    the logits of every decode step."""
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    groups.reset_stats()
    prefill = runner.prefill(seqs)
    stats = groups.stats()
    steps: list[torch.Tensor] = []
    runner.kv = None
    tokens = generate(runner, seqs, new_tokens, observe=steps.append) if new_tokens else []
    return {"prefill": prefill, "stats": stats, "tokens": tokens, "steps": steps}


def layout_task(info: RankInfo, layout: ParallelLayout, model_dirs: dict[str, Path],
                seqs: list[list[int]], new_tokens: int | dict[str, int]) -> dict | None:
    """new_tokens: one count for every model, or a count per model kind."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    counts = new_tokens if isinstance(new_tokens, dict) else dict.fromkeys(model_dirs,
                                                                           new_tokens)
    out = {kind: run_model(groups, d, seqs, counts[kind]) for kind, d in model_dirs.items()}
    return out if info.rank == 0 else {k: {"stats": v["stats"]} for k, v in out.items()}


def groups_task(info: RankInfo, layout: ParallelLayout) -> dict:
    """Members of each group and which kinds share one torch ProcessGroup object."""
    import torch.distributed as dist

    groups = ProcessGroups.build(layout, info.rank, info.device)
    kinds = ("attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp", "moe")
    g = {k: getattr(groups, k) for k in kinds}
    same = {(a, b): g[a].pg is g[b].pg and g[a].pg is not None
            for a in kinds for b in kinds if a < b}
    return {"members": {k: list(g[k].ranks) for k in kinds}, "same_pg": same,
            "is_world": {k: g[k].pg is dist.group.WORLD for k in kinds}}


def kv_and_sampling_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                         seqs: list[list[int]], sampling, new_tokens: int) -> dict:
    """Per-rank KV bytes of the pages held right after a prefill (one-token pages, so page
    rounding does not hide replication), then seeded sampling of new tokens (default pages)."""
    from cpmoe.engine.generate import kv_slots_needed

    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    lens = [len(s) for s in seqs]
    kv = runner.allocate_kv(kv_slots_needed(lens, new_tokens, layout.attn_cp_size,
                                            layout.cp_strategy, 1), page_size=1)
    runner.prefill(seqs, list(range(len(seqs))), last_only=True)
    kv_bytes = kv.nbytes_used()
    for key in list(kv.seqs):
        kv.free(key)
    kv = runner.allocate_kv(kv_slots_needed(lens, new_tokens, layout.attn_cp_size,
                                            layout.cp_strategy))
    tokens = generate(runner, seqs, new_tokens, (), sampling)
    return {"kv_bytes": kv_bytes, "tokens": tokens, "kv_used_after": kv.used}


def fp8_kv_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                seqs: list[list[int]], new_tokens: int, chunk: int) -> dict:
    """Greedy decoding over FP8 K/V pools (--kv-cache-dtype fp8_e4m3), prompts prefilled
    `chunk` tokens a step (later chunks attend their cached, CP-sharded prefix) -> tokens,
    the logits of every step that sampled and the prompt index of each of their rows."""
    from unittest import mock

    from cpmoe.engine.options import EngineOptions
    from cpmoe.engine.scheduler import Scheduler

    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    steps: list[torch.Tensor] = []
    rows: list[list[int]] = []
    planned: list[int] = []
    sample_rows = Scheduler.sample_rows

    def spy(sched: Scheduler, plan) -> list:
        # the driver asks for a step's rows right before it shows its logits to `observe`
        reqs = sample_rows(sched, plan)
        planned[:] = [r.rid for r in reqs]  # generate: request i is prompt i
        return reqs

    def observe(logits: torch.Tensor) -> None:
        steps.append(logits)
        rows.append(list(planned))

    opts = EngineOptions(kv_cache_dtype="fp8_e4m3", chunked_prefill_size=chunk)
    with mock.patch.object(Scheduler, "sample_rows", spy):
        tokens = generate(runner, seqs, new_tokens, observe=observe, options=opts)
    assert runner.kv.k[0].dtype == torch.float8_e4m3fn
    return {"tokens": tokens, "steps": steps, "rows": rows}


def placement_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                   calibration: list[list[int]], seqs: list[list[int]], new_tokens: int
                   ) -> dict:
    """Record expert load on calibration prompts, re-place the experts, then run the model:
    its outputs must not change."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    runner.record_expert_load()
    runner.prefill(calibration)
    report = runner.rebalance_experts()
    prefill = runner.prefill(seqs)
    runner.kv = None
    steps: list[torch.Tensor] = []
    tokens = generate(runner, seqs, new_tokens, observe=steps.append)
    return {"report": report, "prefill": prefill, "tokens": tokens, "steps": steps}


def step_stats_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                    seqs: list[list[int]]) -> dict:
    """Collectives issued, per group kind, by one prefill (KV kept) and by the one decode
    step that follows it (every sequence gets token 1)."""
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    runner.allocate_kv(2 * sum(len(s) + 1 for s in seqs))  # room to spare on every CP rank
    keys = list(range(len(seqs)))
    groups.reset_stats()
    runner.prefill(seqs, keys, last_only=True)
    prefill = groups.stats()
    groups.reset_stats()
    runner.decode(keys, [1] * len(seqs))
    return {"prefill": prefill, "decode": groups.stats()}
