"""`cpmoe generate` on one rank: a batch of prompts through the engine loop (engine.py),
the same scheduler and steps that serve runs. Prompt i samples from stream i of the seed.
Every rank returns the same tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpmoe.cp.kv_cache import CacheFullError, pages_for, request_rank_tokens
from cpmoe.engine.engine import (BatchFrontend, Driver, EngineOptions, engine_loop,
                                 prefill_chunk, radix_cache)
from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sampling import SamplingParams
from cpmoe.engine.scheduler import Request, Scheduler


def kv_slots_needed(prompt_lens: list[int], max_new_tokens: int, cp_size: int,
                    strategy: str, page_size: int = EngineOptions.page_size,
                    chunk: int = 0) -> int:
    """KV token slots (whole pages) the busiest CP rank needs to hold all prompts at their
    longest at once (O(cp) per prompt, whatever max_new_tokens is)."""
    pages = [0] * cp_size
    for n in prompt_lens:
        for r, c in enumerate(request_rank_tokens(n, max_new_tokens, cp_size, strategy, chunk)):
            pages[r] += pages_for(c, page_size)
    return max(pages) * page_size


def generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
             eos_ids: tuple[int, ...] = (), sampling: SamplingParams = SamplingParams(),
             observe: Callable[[torch.Tensor], None] | None = None,
             options: EngineOptions = EngineOptions()) -> list[list[int]]:
    """-> new tokens per prompt (an EOS token, when produced, ends its list), on every rank.
    `observe` (rank 0) sees the logits [rows, V] of every step that sampled tokens. Without
    a KV cache, one just large enough for all prompts at once is allocated."""
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    layout = runner.layout
    chunk = prefill_chunk(runner, options)
    if runner.kv is None:
        runner.allocate_kv(kv_slots_needed([len(p) for p in prompts], max_new_tokens,
                                           layout.attn_cp_size, layout.cp_strategy,
                                           options.page_size, chunk), options.page_size)
    kv = runner.kv
    for i, p in enumerate(prompts):
        need = kv_slots_needed([len(p)], max_new_tokens, kv.cp_size, layout.cp_strategy,
                               kv.page_size, chunk)
        if need > kv.capacity:
            raise CacheFullError(f"prompt {i} ({len(p)} tokens) with {max_new_tokens} new "
                                 f"tokens needs {need} KV slots on the busiest CP rank, the "
                                 f"cache has {kv.capacity} (--max-total-tokens)")
    driver = None
    if runner.groups.rank == 0:
        requests = [Request(i, list(p), sampling, max_new_tokens, stream=i)
                    for i, p in enumerate(prompts)]
        sched = Scheduler(kv, layout.cp_strategy, chunk, options.max_running_requests,
                          eos_ids, radix=radix_cache(runner, options))
        driver = Driver(runner, sched, BatchFrontend(requests), observe=observe,
                        overlap=not options.disable_overlap_schedule)
    return engine_loop(runner, driver)
