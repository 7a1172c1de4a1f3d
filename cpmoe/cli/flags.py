"""The flags every `cpmoe` command shares (layout, model, context, engine: SGLang's names) and
their checks: each bad value is one `InputError` / `LayoutError` line naming the flag, raised
in the parent process before any rank is spawned."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from cpmoe.config import ConfigError, parse_dtype
from cpmoe.context import context_length, over_context
from cpmoe.cp.kv_cache import CacheFullError
from cpmoe.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from cpmoe.engine.runner import LOAD_FORMATS
from cpmoe.engine.sizing import QUANTIZATIONS
from cpmoe.engine.scheduler import SCHEDULE_POLICIES
from cpmoe.loader import LoadError
from cpmoe.models.registry import check_model_fit, load_model_config, model_class
from cpmoe.moe.dispatch import MissingBackendError
from cpmoe.parallel.launch import torchrun_rank
from cpmoe.parallel.layout import BACKENDS, CP_STRATEGIES, LayoutError, ParallelLayout


class InputError(ValueError):
    """Bad user input other than layout/config; one line naming the flag or file."""


TORCHRUN_QUIET_EXIT_S = 2.0  # how long a silent rank waits before exiting on bad input


USER_ERRORS = (LayoutError, ConfigError, LoadError, InputError, MissingBackendError,
               CacheFullError)


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel layout (SGLang flags)")
    g.add_argument("--tp-size", type=int, default=1, help="ranks of one model replica")
    g.add_argument("--attn-cp-size", type=int, default=1, help="attention context parallel")
    g.add_argument("--moe-dp-size", type=int, default=1, help="MoE data parallel (1 or CP)")
    g.add_argument("--ep-size", type=int, default=1, help="MoE expert parallel")
    g.add_argument("--moe-a2a-backend", default="none", choices=BACKENDS)
    g.add_argument("--cp-strategy", default="zigzag", choices=CP_STRATEGIES,
                   help="zigzag (fast path on CUDA) or interleave (exact, but on CUDA a slow "
                        "fallback: masked attention with a host sync per 1,024-query chunk)")
    g.add_argument("--dp-size", type=int, default=1, help="attention data parallel (only 1)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help=f"HF checkpoint directory (default: built-in {DEFAULT_MODEL_NAME})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available")
    p.add_argument("--dtype", default=None, help="float32|bfloat16|float16 "
                   "(default: float32 on cpu, bfloat16 on cuda). On CUDA only bfloat16 takes "
                   "the fast paths: float16 runs the experts as a loop of one matmul pair per "
                   "expert (after a host sync); float32 does too and also takes the masked "
                   "attention fallback")


def add_context_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-length", type=int, default=None,
                   help="most positions of one sequence, prompt + new tokens (default: the "
                        "model's max_position_embeddings; only a shorter one can be set)")


def context_from_args(args: argparse.Namespace, cfg) -> int:
    try:
        return context_length(cfg.max_position_embeddings, args.context_length)
    except ValueError as e:
        raise InputError(str(e)) from None


def check_context(lengths: list[int], max_tokens: int, context: int, max_flag: str) -> None:
    """One line for the first prompt (of `lengths`) that does not fit the context length."""
    for i, n in enumerate(lengths):
        what = "prompt" if len(lengths) == 1 else f"prompt {i}"
        refusal = over_context(n, max_tokens, context, what, max_flag)
        if refusal:
            raise InputError(refusal)


def add_engine_flags(p: argparse.ArgumentParser, max_total_default: str) -> None:
    """The engine's flags (SGLang names), shared by generate, check, serve and benchmarks."""
    from cpmoe.engine.options import EngineOptions
    d = EngineOptions()
    g = p.add_argument_group("engine (SGLang flags)")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help=f"KV cache token slots per rank (default: {max_total_default})")
    g.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="on CUDA without --max-total-tokens: weights + KV cache take this "
                        "fraction of GPU memory")
    g.add_argument("--page-size", type=int, default=d.page_size,
                   help="tokens per KV cache page")
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="prompt tokens prefilled per step (longer prompts go in chunks while "
                        "running requests keep decoding); -1: whole prompts")
    g.add_argument("--max-running-requests", "--max-running", type=int,
                   default=d.max_running_requests, dest="max_running_requests",
                   help="requests decoded together at most")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="decode eagerly instead of replaying CUDA graphs")
    g.add_argument("--disable-radix-cache", action="store_true",
                   help="do not share prompt prefixes between requests (the prefix cache "
                        "over the CP-sharded pages is on by default)")
    g.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES, default="fcfs",
                   help="order of admitting waiting requests: fcfs (arrival) or lpm (longest "
                        "prefix in the prefix cache first, while at most 128 wait)")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="bring each step's tokens to the host before planning the next "
                        "(by default greedy steps feed the next step on the device and the "
                        "host plans while the device computes)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                   help="largest decode batch captured in a CUDA graph (larger run eagerly)")
    g.add_argument("--routing", choices=("model", "uniform"), default="model",
                   help="uniform (random weights, benchmarks): redraw the routers at start so "
                        "expert load is near-uniform, as a trained router's is on average")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights at the shape of --model's config.json (no "
                        "checkpoint read; the tokenizer still comes from --model)")
    add_quantization_flag(g)
    add_kv_cache_dtype_flag(g)


def add_kv_cache_dtype_flag(g) -> None:
    from cpmoe.cp.kv_cache import KV_CACHE_DTYPES
    g.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                   help="K/V cache pools: auto (the model's dtype) or FP8 (scale 1, "
                        "saturating), half the bytes per token: twice the tokens in the same "
                        "memory and half of what decode attention reads; attention computes "
                        "in the model's dtype")


def add_quantization_flag(g) -> None:
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: quantize 16-bit (or dummy) weights to 128x128-block FP8 at load "
                        "(FP8 GEMMs on CUDA, FP8-rounded weights on CPU); FP8 checkpoints "
                        "load as FP8 without it")


def engine_options(args: argparse.Namespace, cfg=None):
    """The engine flags, checked; with the model's config, also against the model."""
    from cpmoe.engine.options import EngineOptions
    from cpmoe.engine.sizing import kv_cache_refusal
    refusal = cfg and kv_cache_refusal(args.kv_cache_dtype, model_class(cfg.architecture))
    if refusal:
        raise InputError(refusal)
    for flag in ("page_size", "max_running_requests", "cuda_graph_max_bs"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, flag)}")
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        raise InputError(f"--chunked-prefill-size must be -1 or >= 1, got "
                         f"{args.chunked_prefill_size}")
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        raise InputError(f"--max-total-tokens must be >= 1, got {args.max_total_tokens}")
    if not 0.0 < args.mem_fraction_static < 1.0:
        raise InputError(f"--mem-fraction-static must be in (0, 1), got "
                         f"{args.mem_fraction_static}")
    return EngineOptions(page_size=args.page_size,
                         chunked_prefill_size=args.chunked_prefill_size,
                         max_running_requests=args.max_running_requests,
                         disable_cuda_graph=args.disable_cuda_graph,
                         disable_radix_cache=args.disable_radix_cache,
                         schedule_policy=args.schedule_policy,
                         disable_overlap_schedule=args.disable_overlap_schedule,
                         cuda_graph_max_bs=args.cuda_graph_max_bs,
                         max_total_tokens=args.max_total_tokens,
                         mem_fraction_static=args.mem_fraction_static,
                         load_format=args.load_format, routing=args.routing,
                         quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    if args.dp_size != 1:
        raise LayoutError(f"--dp-size {args.dp_size}: attention data parallelism is not "
                          f"supported (use --attn-cp-size)")
    layout = ParallelLayout(tp_size=args.tp_size, attn_cp_size=args.attn_cp_size,
                            moe_dp_size=args.moe_dp_size, ep_size=args.ep_size,
                            moe_a2a_backend=args.moe_a2a_backend, cp_strategy=args.cp_strategy)
    if torchrun_rank() is not None and int(os.environ["WORLD_SIZE"]) != layout.world_size:
        raise LayoutError(f"--tp-size {layout.tp_size}: torchrun started WORLD_SIZE="
                          f"{os.environ['WORLD_SIZE']} processes; nnodes x nproc-per-node "
                          f"must equal the layout's {layout.world_size} ranks")
    return layout


def model_dir_from_args(args: argparse.Namespace) -> Path:
    if args.model is None:
        return ensure_default_model()
    if not args.model.is_dir():
        raise InputError(f"--model {args.model}: not a directory")
    return args.model


def resolve(args: argparse.Namespace):
    """Layout, model dir, config, device, dtype; validated before any rank exists."""
    layout = layout_from_args(args)
    model_dir = model_dir_from_args(args)
    cfg, _ = load_model_config(model_dir)
    check_model_fit(layout, cfg)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < layout.world_size \
            and "WORLD_SIZE" not in os.environ:
        raise InputError(f"--device cuda: --tp-size {layout.world_size} needs that many GPUs, "
                         f"{torch.cuda.device_count()} visible")
    dtype = parse_dtype(args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    from cpmoe.engine.sizing import fp8_attention_refusal
    refusal = fp8_attention_refusal(getattr(args, "kv_cache_dtype", "auto"),
                                    torch.device(device), dtype)
    if refusal:
        raise InputError(refusal)
    return layout, model_dir, cfg, device, dtype


def tokenizer_of(model_dir: Path):
    if not (model_dir / "tokenizer.json").exists() and \
            not (model_dir / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))
