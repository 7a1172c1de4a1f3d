"""Rank tasks for the layout tests (module-level, so spawned ranks can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from cpmoe.engine.generate import generate, greedy
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

    def pick(logits: torch.Tensor) -> list[int]:
        steps.append(logits.clone())
        return greedy(logits)

    runner.kv = None
    tokens = generate(runner, seqs, new_tokens, (), pick) if new_tokens else []
    kv_bytes = runner.kv.nbytes_used() if runner.kv is not None else 0
    return {"prefill": prefill, "stats": stats, "tokens": tokens, "steps": steps,
            "kv_bytes_after_prefill": kv_bytes}


def layout_task(info: RankInfo, layout: ParallelLayout, model_dirs: dict[str, Path],
                seqs: list[list[int]], new_tokens: int) -> dict | None:
    groups = ProcessGroups.build(layout, info.rank, info.device)
    out = {kind: run_model(groups, d, seqs, new_tokens) for kind, d in model_dirs.items()}
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
