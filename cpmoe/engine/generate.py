"""`cpmoe generate` on one rank: a batch of prompts through the engine loop (engine.py),
the same scheduler and steps that serve runs. Prompt i samples from stream i of the seed.
Every rank returns the same tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpmoe.cp.kv_cache import CacheFullError
from cpmoe.cp.kv_capacity import kv_slots_needed, over_capacity
from cpmoe.engine.engine import BatchFrontend, Driver, engine_loop
from cpmoe.engine.options import EngineOptions, radix_cache
from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sampling import SamplingParams
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import Request


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
    chunk = options.chunked_prefill_size
    if runner.kv is None:
        runner.allocate_kv(kv_slots_needed([len(p) for p in prompts], max_new_tokens,
                                           layout.attn_cp_size, layout.cp_strategy,
                                           options.page_size, chunk), options.page_size,
                            options.kv_cache_dtype, options.max_running_requests)
    kv = runner.kv
    for i, p in enumerate(prompts):
        need = kv_slots_needed([len(p)], max_new_tokens, kv.cp_size, layout.cp_strategy,
                               kv.page_size, chunk)
        refusal = over_capacity(len(p), max_new_tokens, need, kv.capacity)
        if refusal:
            raise CacheFullError(f"prompt {i}: {refusal}")
    driver = None
    if runner.groups.rank == 0:
        requests = [Request(i, list(p), sampling, max_new_tokens, stream=i)
                    for i, p in enumerate(prompts)]
        sched = Scheduler(kv, layout.cp_strategy, chunk, options.max_running_requests,
                          eos_ids, radix=radix_cache(runner, options),
                          policy=options.schedule_policy)
        driver = Driver(runner, sched, BatchFrontend(requests), observe=observe,
                        overlap=not options.disable_overlap_schedule)
    return engine_loop(runner, driver)
