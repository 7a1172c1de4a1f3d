"""Rank tasks of test_bf16_model.py (module-level, so spawned ranks can import them)."""

from __future__ import annotations

import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


def cp_prefill_task(info: RankInfo, config: dict, seqs: list[list[int]]
                    ) -> torch.Tensor | None:
    """tp=2, cp=2, ep=2 with alltoall_padded dispatch, bf16 (random weights, seed 3):
    rank 0 returns every token's logits."""
    layout = ParallelLayout(tp_size=2, attn_cp_size=2, ep_size=2,
                            moe_a2a_backend="alltoall_padded")
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner.from_config(config, groups, torch.bfloat16, seed=3)
    logits = runner.prefill(seqs).float().cpu()
    return logits if info.rank == 0 else None
