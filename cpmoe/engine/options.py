"""The engine's options (SGLang's flags) and what a runner needs before the first step:
prompt tokens per step, whether prefixes are shared, the KV cache sized from
--max-total-tokens or --mem-fraction-static, the decode CUDA graphs, and a warm-up prefill so
the first requests compile nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpmoe.cp.kv_cache import CacheFullError
from cpmoe.cp.kv_capacity import DEFAULT_PAGE_SIZE
from cpmoe.engine.runner import ModelRunner, Segment, StepTimes


DEFAULT_CHUNKED_PREFILL = 8192  # --chunked-prefill-size (SGLang's default on large GPUs)


@dataclass(frozen=True)
class EngineOptions:
    """The engine flags shared by generate, check, serve and the benchmarks."""

    page_size: int = DEFAULT_PAGE_SIZE  # --page-size
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL  # -1: prompts in one piece
    max_running_requests: int = 256
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    max_total_tokens: int | None = None  # KV slots per rank; None: the command's default
    mem_fraction_static: float = 0.85  # CUDA, no max_total_tokens: weights + KV share
    load_format: str = "auto"
    routing: str = "model"  # "uniform": redraw routers for even expert load (benchmarks)
    quantization: str | None = None  # "fp8": 16-bit weights to [128, 128] FP8 blocks at load
    disable_radix_cache: bool = False  # --disable-radix-cache: no prefix sharing
    schedule_policy: str = "fcfs"  # --schedule-policy: admission order (fcfs | lpm)
    disable_overlap_schedule: bool = False  # --disable-overlap-schedule: tokens to the host
    # before the next step is planned
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: the K/V pools' (kv_cache.KV_CACHE_DTYPES)


def radix_cache(runner: ModelRunner, opts: EngineOptions) -> bool:
    """Whether the scheduler shares prompt prefixes: on unless --disable-radix-cache, for
    models whose K/V live in the paged cache (not DeepSeek-V4's own per-sequence state)."""
    return not opts.disable_radix_cache and not runner.own_cache


def prepare_runner(runner: ModelRunner, opts: EngineOptions, default_tokens: int | None,
                   ) -> dict:
    """The KV cache (`max_total_tokens`, else on CUDA what `mem_fraction_static` leaves,
    else `default_tokens`) and the decode CUDA graphs -> sizes for reports."""
    if opts.routing == "uniform":
        from cpmoe.moe.uniform_routing import calibrate_on_random_prompts
        calibrate_on_random_prompts(runner)
    tokens, seqs = opts.max_total_tokens, opts.max_running_requests
    if tokens is None:
        tokens = (runner.kv_tokens_for_memory(opts.mem_fraction_static, opts.kv_cache_dtype,
                                              seqs)
                  if runner.device.type == "cuda" or default_tokens is None else default_tokens)
        if tokens < opts.page_size:
            raise CacheFullError(
                f"--mem-fraction-static {opts.mem_fraction_static} leaves no room for the KV "
                f"cache next to the {_in_use_gib(runner.device):.1f} GiB already in use on "
                f"{runner.device}: raise it or set --max-total-tokens")
    kv = runner.allocate_kv(tokens, opts.page_size, opts.kv_cache_dtype, seqs)
    graph_bytes = 0
    if not opts.disable_cuda_graph and runner.can_capture_graphs():
        graph_bytes = runner.capture_decode_graphs(opts.cuda_graph_max_bs)
    if runner.device.type == "cuda":
        warm_up_prefill(runner, opts.chunked_prefill_size)
    # kv_cp_size: the ranks a request's tokens spread over in the token accounting (1 for
    # a model's own cache, whose books every rank keeps whole), for admission's arithmetic
    return {"kv_capacity": kv.capacity, "graph_bytes": graph_bytes, "kv_cp_size": kv.cp_size}


def _in_use_gib(device: torch.device) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


WARM_UP_KEY = -1  # a cache key no request uses


def warm_up_prefill(runner: ModelRunner, chunk: int) -> None:
    """One full prefill chunk, then extends of 16, 32, 64, ... tokens after it (the
    cached-prefix path; each shorter than the chunk, while the cache and the model's context
    length hold the sequence), on a sequence freed again, before the first request: the
    kernels a prefill launches are compiled and tuned here, not in the first requests' time
    to first token (SGLang warms up its server the same way). The experts' tile variants
    change where the slots per expert double (`fused_moe._block_m`) or over wider ranges
    (`grouped_fp8_config`), so the ladder meets each variant that a step of up to a chunk
    launches at Qwen3-30B-A3B's shape. Without it, served FP8 steps compiled on the way: a
    466-token step took 1.1 s (the few-slot experts' 64-row tiles), and the first 1K prompt
    1.38 s on an H200 (the grouped FP8 GEMMs' 64-row tiles; bf16's first: 88 ms,
    bench/results/fp8-serving-h200-1d2b62c.log)."""
    kv = runner.kv
    n = min(chunk if chunk > 0 else DEFAULT_CHUNKED_PREFILL, kv.capacity // 2)
    if n < 32:
        return
    ids = [(i * 7919) % runner.config.vocab_size for i in range(n)]
    room = min(kv.capacity, runner.config.max_position_embeddings)  # a sequence's longest
    if runner.fp8_attention:  # FP8 attention's cuDNN graphs, one per length bucket
        from cpmoe.cp.fp8_attention import warm_up
        attn = runner.model.model.layers[0].self_attn
        # a prefix on a rank is at most a sequence's: the context length, if the cache holds it
        warm_up(runner.device, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, n,
                room)
    runner.extend([Segment(WARM_UP_KEY, ids)])
    start, size = n, 16
    while size < n and start + size <= room:
        runner.extend([Segment(WARM_UP_KEY, ids[:size], start)])
        start, size = start + size, 2 * size
    kv.free(WARM_UP_KEY)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    runner.times = StepTimes()  # what requests take, not the warm-up
