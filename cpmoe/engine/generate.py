"""Batched generation on one rank: CP prefill of every prompt, then decode steps until each
prompt hits EOS or its token budget. All ranks run this loop in lockstep and pick the same
tokens (logits are identical on every rank)."""

from __future__ import annotations

import torch

from cpmoe.engine.runner import ModelRunner


def greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
             eos_ids: tuple[int, ...] = (), pick=greedy) -> list[list[int]]:
    """-> new tokens per prompt (an EOS token, when produced, ends its list)."""
    if runner.kv is None:
        runner.allocate_kv(sum(len(p) for p in prompts) + len(prompts) * max_new_tokens)
    keys = list(range(len(prompts)))
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens <= 0:
        return out
    tokens = pick(runner.prefill(prompts, keys, last_only=True))
    active = []
    for key, tok in zip(keys, tokens):
        out[key].append(tok)
        if tok not in eos_ids and max_new_tokens > 1:
            active.append(key)
        else:
            runner.kv.free(key)
    while active:
        tokens = pick(runner.decode(active, [out[k][-1] for k in active]))
        still = []
        for key, tok in zip(active, tokens):
            out[key].append(tok)
            if tok in eos_ids or len(out[key]) >= max_new_tokens:
                runner.kv.free(key)
            else:
                still.append(key)
        active = still
    return out
