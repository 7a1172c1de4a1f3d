"""Batched generation on one rank: CP prefill of every prompt, then decode steps until each
prompt hits EOS or its token budget. All ranks run this loop in lockstep; the chosen tokens
are broadcast from rank 0 so every rank feeds back exactly the same ones."""

from __future__ import annotations

from typing import Callable

import torch

from cpmoe.cp.split import CPSplit
from cpmoe.engine.kv_cache import busiest_rank_tokens
from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sampling import SamplingParams, sample


def kv_slots_needed(prompt_lens: list[int], max_new_tokens: int, cp_size: int,
                    strategy: str) -> int:
    """KV slots the busiest rank needs to generate for all prompts at once."""
    split = CPSplit.build(prompt_lens, cp_size, strategy)
    return busiest_rank_tokens([list(c) for c in split.seq_counts], max_new_tokens)


def generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
             eos_ids: tuple[int, ...] = (), sampling: SamplingParams = SamplingParams(),
             observe: Callable[[torch.Tensor], None] | None = None) -> list[list[int]]:
    """-> new tokens per prompt (an EOS token, when produced, ends its list). `observe`
    sees the logits [B_active, V] of every step (prefill included)."""
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens <= 0:
        return out
    layout = runner.layout
    need = kv_slots_needed([len(p) for p in prompts], max_new_tokens, layout.attn_cp_size,
                           layout.cp_strategy)
    if runner.kv is None:
        runner.allocate_kv(need)
    runner.check_fits(need)
    keys = list(range(len(prompts)))

    def choose(logits: torch.Tensor, rows: list[int], step: int) -> list[int]:
        if observe is not None:
            observe(logits)
        return runner.agree(sample(logits, sampling, rows, step))

    active, feed = keys, choose(runner.prefill(prompts, keys, last_only=True), keys, 0)
    step = 0
    while active:
        still = []
        for key, tok in zip(active, feed):
            out[key].append(tok)
            if tok in eos_ids or len(out[key]) >= max_new_tokens:
                runner.kv.free(key)
            else:
                still.append(key)
        active = still
        if not active:
            break
        step += 1
        feed = choose(runner.decode(active, [out[k][-1] for k in active]), active, step)
    return out
