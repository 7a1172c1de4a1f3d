"""`cpmoe` command line: plan / prefill / generate / check / bench / serve.

Everything a user can get wrong (layout flags, model fit, input files) is checked in the
parent process before any rank is spawned; a failure prints one line and exits 2 without
writing output. A failing rank ends the whole job (exit 1) with its error shown; a user
error found on a rank (a broken checkpoint) prints the same one line and exits 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

from cpmoe import communicator
from cpmoe.config import ConfigError, parse_dtype, read_json_file
from cpmoe.context import context_length, over_context
from cpmoe.cp.kv_cache import CacheFullError
from cpmoe.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from cpmoe.engine.runner import LOAD_FORMATS, QUANTIZATIONS, with_quantization
from cpmoe.engine.scheduler import SCHEDULE_POLICIES
from cpmoe.loader import LoadError
from cpmoe.models.registry import check_model_fit, load_model_config, model_class
from cpmoe.moe.dispatch import MissingBackendError
from cpmoe.parallel.failures import RankFailure, peer_loss
from cpmoe.parallel.launch import launch, torchrun_rank
from cpmoe.parallel.layout import BACKENDS, CP_STRATEGIES, LayoutError, ParallelLayout
from cpmoe.serve.options import add_serve_arguments


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
    from cpmoe.engine.engine import EngineOptions
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
    from cpmoe.engine.engine import EngineOptions
    from cpmoe.engine.runner import kv_cache_refusal
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
    from cpmoe.engine.runner import fp8_attention_refusal
    refusal = fp8_attention_refusal(getattr(args, "kv_cache_dtype", "auto"),
                                    torch.device(device), dtype)
    if refusal:
        raise InputError(refusal)
    return layout, model_dir, cfg, device, dtype


# ---- commands ---------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    from cpmoe.engine.runner import kv_cache_refusal, memory_per_rank
    layout, model_dir, cfg, _, dtype = resolve(args)
    out = layout.summary()
    sparse = [cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)]
    out["layer_modes"] = [{"layer": p.layer, "sparse": p.sparse, "attn": p.attn.value,
                           "mlp": p.mlp.value} for p in communicator.plan_layers(layout, sparse)]
    model_cls = load_model_config(model_dir)[1]
    note = model_cls.decode_cache_for(cfg, layout, dtype)
    if note:
        out["decode_cache"] = note
    out["dtype"] = str(dtype).removeprefix("torch.")
    cfg = with_quantization(cfg, args.quantization)
    refusal = kv_cache_refusal(args.kv_cache_dtype, model_cls)
    if refusal:
        raise InputError(refusal)
    out["kv_cache_dtype"] = args.kv_cache_dtype
    out["memory_per_rank"] = memory_per_rank(cfg, model_cls, layout, dtype, args.kv_cache_dtype)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"model: {model_dir} ({cfg.architecture})")
    print("sizes: " + ", ".join(f"{k}={v}" for k, v in out.items()
                                if k not in ("groups", "layer_modes", "memory_per_rank",
                                             "decode_cache")))
    for kind, members in out["groups"].items():
        print(f"  {kind:<8} " + " ".join(str(m) for m in members))
    modes: dict[tuple[str, str], list[int]] = {}
    for m in out["layer_modes"]:
        modes.setdefault((m["attn"], m["mlp"]), []).append(m["layer"])
    for (attn, mlp), layers in modes.items():
        print(f"  layers {layers}: attention {attn}, mlp {mlp}")
    for m in out["memory_per_rank"]:
        kv = m["kv_bytes_per_token"]
        kv_text = ("the model's own decode cache (below)" if kv is None else
                   f"KV {kv} bytes per stored token ({kv / layout.attn_cp_size:.0f} per prompt "
                   f"token: the KV of a prompt is sharded over {layout.attn_cp_size} CP ranks)")
        fp8 = m.get("fp8_on_cuda")
        fp8_text = ("" if fp8 is None else
                    f" ({fp8['weight_bytes'] / 2**30:.3f} GiB on CUDA with FP8 weights: "
                    f"{fp8['fp8_bytes'] / 2**30:.3f} GiB FP8 weights + scales)")
        print(f"  rank {m['rank']}: weights {m['weight_bytes'] / 2**30:.3f} GiB "
              f"({out['dtype']}){fp8_text}, {kv_text}")
    if note:
        print(f"decode cache: {note}")
    return 0


def read_id_batch(path: Path, vocab_size: int) -> list[list[int]]:
    data = read_json_file(path, "--input-ids-file", InputError)
    if not isinstance(data, list) or not data:
        raise InputError(f"--input-ids-file {path}: expected a non-empty JSON list of token-id "
                         f"lists")
    for i, seq in enumerate(data):
        check_ids(seq, vocab_size, f"--input-ids-file {path}: sequence {i}")
    return data


def check_ids(seq, vocab_size: int, where: str) -> None:
    if not isinstance(seq, list) or not seq:
        raise InputError(f"{where}: expected a non-empty list of token ids, got "
                         f"{json.dumps(seq)[:40]}")
    for t in seq:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InputError(f"{where}: token id {t!r} outside [0, {vocab_size})")


def cmd_prefill(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from cpmoe.engine.rank_tasks import RunSpec, prefill_task
    layout, model_dir, cfg, device, dtype = resolve(args)
    seqs = read_id_batch(args.input_ids_file, cfg.vocab_size)
    check_context([len(q) for q in seqs], 0, context_from_args(args, cfg), "")
    out_path = Path(args.dump_logits)
    if not out_path.parent.is_dir():
        raise InputError(f"--dump-logits {out_path}: folder {out_path.parent} does not exist")
    if out_path.is_dir():
        raise InputError(f"--dump-logits {out_path}: is a directory; give a file name")
    spec = RunSpec(model_dir, layout, dtype)
    logits = launch(prefill_task, layout.world_size, device, spec, seqs)
    if logits is None:  # a non-zero torchrun rank
        return 0
    tmp = out_path.with_name(out_path.name + ".tmp")
    save_file({f"logits.{i}": t.float().contiguous() for i, t in enumerate(logits)}, str(tmp))
    os.replace(tmp, out_path)
    print(f"wrote logits of {len(seqs)} sequence(s) to {out_path}")
    return 0


def read_prompts(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[list[int]]:
    """--prompt TEXT | --input-ids 1,2,3 | --prompts-file F (JSON list of strings/id lists)."""
    if args.input_ids is not None:
        try:
            prompts = [[int(t) for t in args.input_ids.split(",")]]
        except ValueError:
            raise InputError(f"--input-ids {args.input_ids!r}: expected comma-separated "
                             f"integers") from None
        where = ["--input-ids"]
    elif args.prompt is not None:
        prompts, where = [args.prompt], ["--prompt"]
    else:
        prompts = read_json_file(args.prompts_file, "--prompts-file", InputError)
        if not isinstance(prompts, list) or not prompts:
            raise InputError(f"--prompts-file {args.prompts_file}: expected a non-empty JSON "
                             f"list of strings or token-id lists")
        where = [f"--prompts-file {args.prompts_file}: prompt {i}" for i in range(len(prompts))]
    out = []
    for p, w in zip(prompts, where):
        if isinstance(p, str):
            if tokenizer is None:
                raise InputError(f"{w}: the model has no tokenizer; give token ids instead")
            if not p:
                raise InputError(f"{w}: empty prompt")
            p = tokenizer.encode(p)
        check_ids(p, vocab_size, w)
        out.append(p)
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    from cpmoe.cp.kv_cache import kv_slots_needed, over_capacity
    from cpmoe.engine.sampling import SamplingParams
    from cpmoe.engine.rank_tasks import RunSpec, generate_task
    layout, model_dir, cfg, device, dtype = resolve(args)
    opts = engine_options(args, cfg)
    tokenizer = _tokenizer(model_dir)
    prompts = read_prompts(args, tokenizer, cfg.vocab_size)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_context([len(p) for p in prompts], args.max_new_tokens, context_from_args(args, cfg),
                  "--max-new-tokens")
    try:
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as e:
        raise InputError(str(e)) from None
    if opts.max_total_tokens is not None:
        for i, p in enumerate(prompts):  # the scheduler queues the rest; one must fit alone
            need = kv_slots_needed([len(p)], args.max_new_tokens, layout.attn_cp_size,
                                   layout.cp_strategy, opts.page_size, opts.chunked_prefill_size)
            refusal = over_capacity(len(p), args.max_new_tokens, need, opts.max_total_tokens)
            if refusal:
                raise InputError(f"prompt {i}: {refusal}")
    res = launch(generate_task, layout.world_size, device,
                 RunSpec(model_dir, layout, dtype, options=opts), prompts, args.max_new_tokens,
                 cfg.eos_token_ids, sampling)
    if res is None:
        return 0
    texts = [tokenizer.decode(t) if tokenizer is not None else None for t in res.tokens]
    if args.model is None:
        print(f"cpmoe: note: the built-in {DEFAULT_MODEL_NAME} has random weights, so its "
              f"tokens are noise; give --model DIR for a real checkpoint", file=sys.stderr)
    if args.json:
        print(json.dumps([{"prompt": i, "tokens": t, "text": x}
                          for i, (t, x) in enumerate(zip(res.tokens, texts))]))
    else:
        for i, (t, x) in enumerate(zip(res.tokens, texts)):
            shown = x if x is not None and args.input_ids is None else ",".join(map(str, t))
            print(escape_text(shown) if len(prompts) == 1 else f"[{i}] {shown!r}")
    if args.verbose:
        for r, (w, kv) in enumerate(zip(res.weight_bytes, res.kv_bytes_per_token)):
            fp8 = res.fp8_bytes[r] if res.fp8_bytes else 0
            fp8_text = f" ({fp8 / 2**20:.2f} MiB FP8 weights + scales)" if fp8 else ""
            print(f"rank {r}: weights {w / 2**20:.2f} MiB{fp8_text}, KV {kv} bytes per stored "
                  f"token "
                  f"({kv / layout.attn_cp_size:.0f} per prompt token with attn_cp "
                  f"{layout.attn_cp_size})", file=sys.stderr)
        print(f"KV capacity {res.kv_capacity} tokens per rank (pages of {opts.page_size}); "
              f"CUDA graphs {res.graph_bytes / 2**20:.1f} MiB; host time launching prefill "
              f"{res.prefill_s:.3f} s, {res.decode_steps} decode steps {res.decode_s:.3f} s",
              file=sys.stderr)
    return 0


def escape_text(text: str) -> str:
    """Generated text safe for a terminal: control and other unprintable characters (an
    escape sequence, a bell, a stray byte's control code) as Python escapes; newlines and
    tabs stay."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode()
                   for c in text)


def cmd_check(args: argparse.Namespace) -> int:
    from cpmoe.check import check_task
    from cpmoe.engine.rank_tasks import RunSpec
    layout, model_dir, cfg, device, dtype = resolve(args)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise InputError(f"--lengths {args.lengths!r}: expected comma-separated integers") \
            from None
    if args.prompts < 1 or not lengths or min(lengths) < 1:
        raise InputError(f"--prompts {args.prompts} and --lengths {args.lengths} must be "
                         f"positive")
    if args.decode_steps < 0:
        raise InputError(f"--decode-steps must be >= 0, got {args.decode_steps}")
    context = context_from_args(args, cfg)
    if max(lengths) + args.decode_steps > context:
        raise InputError(f"--lengths {args.lengths} with --decode-steps {args.decode_steps}: "
                         f"{max(lengths) + args.decode_steps} tokens exceed the context "
                         f"length of {context} tokens")
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (lengths[i % len(lengths)],),
                             generator=gen).tolist() for i in range(args.prompts)]
    batches, cur = [], []
    for p in prompts:
        if cur and sum(map(len, cur)) + len(p) > args.max_batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(p)
    batches.append(cur)
    # Rank 0 also runs the one-rank reference while its peers wait in their next
    # collective: give them as long as a long reference prompt can take.
    report = launch(check_task, layout.world_size, device,
                    RunSpec(model_dir, layout, dtype, options=engine_options(args, cfg)), batches,
                    args.decode_steps, args.seed, args.near_tie, args.reference_kv_cache_dtype,
                    collective_timeout_s=3600.0)
    if report is None:
        return 0
    print(f"layout: {json.dumps({k: v for k, v in layout.summary().items() if k != 'groups'})}")
    if args.reference_kv_cache_dtype not in (None, args.kv_cache_dtype):
        print(f"kv cache dtype: layout {args.kv_cache_dtype}, reference "
              f"{args.reference_kv_cache_dtype}")
    for i, p in enumerate(report.prompts):
        where = ("routing margin not measured for this model" if p.margin is None else
                 f"smallest top-k routing margin {p.margin:.2e} at layer {p.margin_at[0]}, "
                 f"position {p.margin_at[1]}{' (NEAR-TIE)' if p.near_tie else ''}")
        if p.index_margin is not None:
            where += (f"; smallest indexer top-k margin {p.index_margin:.2e} at layer "
                      f"{p.index_margin_at[0]}, position {p.index_margin_at[1]}"
                      f"{' (NEAR-TIE)' if p.index_near_tie else ''}")
        print(f"prompt {i} ({p.length} tokens): first token "
              f"{'matches' if p.first_token_match else 'DIFFERS'}, max |logit diff| "
              f"{p.max_abs_diff:.2e}, decode max |logit diff| {p.decode_max_abs_diff:.2e} "
              f"({p.decode_top1_mismatches} top-1 mismatches in {report.decode_steps} steps); "
              f"{where}")
    n = len(report.prompts)
    ties = [i for i, p in enumerate(report.prompts) if p.near_tie]
    print(f"first-token matches: {report.matches}/{n}")
    print(f"max |logit diff|: {report.max_abs_diff:.3e}")
    clean = [p.max_abs_diff for p in report.prompts if not (p.near_tie or p.index_near_tie)]
    print("max |logit diff| of prompts without a routing or indexer near-tie: "
          + (f"{max(clean):.3e}" if clean else "- (every prompt has one)"))
    print(f"mean top-1 log-prob delta: {report.mean_logprob_delta:.3e}")
    print(f"decode: {report.decode_steps} steps per prompt, max |logit diff| "
          f"{max(p.decode_max_abs_diff for p in report.prompts):.3e}, top-1 matches "
          f"{report.decode_steps * n - sum(p.decode_top1_mismatches for p in report.prompts)}"
          f"/{report.decode_steps * n}")
    print(f"routing near-ties (margin <= {report.near_tie:.1e} x max(1, |k-th logit|)): "
          f"{len(ties)} prompt(s){': ' + str(ties) if ties else ''}")
    if any(p.index_margin is not None for p in report.prompts):
        index_ties = [i for i, p in enumerate(report.prompts) if p.index_near_tie]
        print(f"indexer near-ties (margin <= {report.near_tie:.1e} x max(1, |k-th score|)): "
              f"{len(index_ties)} prompt(s){': ' + str(index_ties) if index_ties else ''}")
    mismatched = [i for i, p in enumerate(report.prompts)
                  if not p.first_token_match or p.decode_top1_mismatches]
    if mismatched:
        print(f"mismatched prompts: {mismatched} (of which with a routing near-tie: "
              f"{[i for i in mismatched if i in ties]})")
    failed = report.failures()
    if args.reference_kv_cache_dtype not in (None, args.kv_cache_dtype):
        # two K/V dtypes: a measurement of what the layout's costs, not a pass/fail check
        print(f"first-token agreement with the {args.reference_kv_cache_dtype} reference: "
              f"{report.matches}/{n}")
        return 0
    if failed:
        print(f"failed prompts: {failed}")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from cpmoe.bench.run import run_bench
    from cpmoe.bench.spec import BenchError
    try:
        return run_bench(args, ["cpmoe", *sys.argv[1:]])
    except BenchError as e:
        raise InputError(str(e)) from None


def cmd_bench_one_batch(args: argparse.Namespace) -> int:
    from cpmoe.bench.one_batch_run import run_one_batch
    from cpmoe.bench.spec import BenchError
    layout = layout_from_args(args)
    try:
        return run_one_batch(args, layout, engine_options(args), ["cpmoe", *sys.argv[1:]])
    except BenchError as e:
        raise InputError(str(e)) from None


def cmd_bench_serving(args: argparse.Namespace) -> int:
    from cpmoe.bench.serving import run_bench_serving
    from cpmoe.bench.spec import BenchError
    try:
        return run_bench_serving(args, ["cpmoe", *sys.argv[1:]])
    except BenchError as e:
        raise InputError(str(e)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from cpmoe.serve.options import BindError, ServeOptions
    layout, model_dir, cfg, device, dtype = resolve(args)
    engine = engine_options(args, cfg)
    context = context_from_args(args, cfg)
    try:
        opts = ServeOptions.from_args(args)
    except ValueError as e:
        raise InputError(str(e)) from None
    tokenizer = None if opts.skip_tokenizer_init else _tokenizer(model_dir)
    if tokenizer is None and not opts.skip_tokenizer_init:
        raise InputError(f"--model {model_dir}: no tokenizer files; serve needs a tokenizer "
                         f"(or --skip-tokenizer-init: token ids in and out)")
    from cpmoe.serve.server import serve, serve_in_world  # web imports only for this command
    try:
        if torchrun_rank() is not None:  # torchrun: one server over the whole world
            return launch(serve_in_world, layout.world_size, device, opts, engine, layout,
                          model_dir, cfg, context, device, dtype, tokenizer)
        return serve(opts, engine, layout, model_dir, cfg, context, device, dtype, tokenizer)
    except BindError as e:
        raise InputError(str(e)) from None


def _tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").exists() and \
            not (model_dir / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


class _Help(argparse.HelpFormatter):
    """--help lists every flag's default (flags whose help already names it excepted)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return (bool(action.option_strings) and action.default is not None
                and action.default is not False and action.default != argparse.SUPPRESS
                and "default" not in (action.help or ""))

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):  # argparse skips empty help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not self._shows_default(action) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print sizes, groups and per-layer token layouts")
    add_layout_flags(p)
    add_model_flags(p)
    add_quantization_flag(p)
    add_kv_cache_dtype_flag(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("prefill", help="prefill a batch and dump all-position logits")
    add_layout_flags(p)
    add_model_flags(p)
    p.add_argument("--input-ids-file", type=Path, required=True)
    p.add_argument("--dump-logits", type=Path, required=True)
    add_context_flag(p)
    p.set_defaults(fn=cmd_prefill)
    p = sub.add_parser("generate", help="generate tokens: greedy by default, sampled with "
                       "--temperature > 0", formatter_class=_Help)
    add_layout_flags(p)
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--input-ids")
    src.add_argument("--prompts-file", type=Path, help="JSON list of strings or id lists")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    add_context_flag(p)
    add_engine_flags(p, "what the prompts need at once on CPU; --mem-fraction-static on CUDA")
    p.add_argument("--json", action="store_true", help="print tokens and text as JSON")
    p.add_argument("--verbose", action="store_true", help="per-rank memory and timings")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("check", help="compare a layout against the one-rank reference")
    add_layout_flags(p)
    add_model_flags(p)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--lengths", default="17,64,129")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--decode-steps", type=int, default=4,
                   help="decode steps compared per prompt, both runs fed the same tokens; a "
                        "top-1 difference fails the check in float32 and is reported in 16-bit")
    p.add_argument("--near-tie", type=float, default=None,
                   help="flag a prompt whose top-k router margin (k-th minus (k+1)-th logit) "
                        "falls to this x max(1, |k-th logit|) or below anywhere; default 1e-5 "
                        "in float32, 2^-8 in 16-bit dtypes (reported; it excuses no mismatch)")
    from cpmoe.cp.kv_cache import KV_CACHE_DTYPES
    p.add_argument("--reference-kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default=None,
                   help="the one-rank reference's --kv-cache-dtype (default: the layout's); "
                        "e.g. --kv-cache-dtype fp8_e4m3 --reference-kv-cache-dtype auto measures "
                        "what FP8 K/V and FP8 attention cost against 16-bit")
    add_context_flag(p)
    add_engine_flags(p, "what each batch needs")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                       formatter_class=_Help)
    add_layout_flags(p)
    add_model_flags(p)
    add_serve_arguments(p)
    add_context_flag(p)
    add_engine_flags(p, "16384 on CPU; --mem-fraction-static on CUDA")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("bench", help="prefill throughput of random-weight models over layouts")
    from cpmoe.bench.run import add_arguments as add_bench_arguments  # not in every rank
    add_bench_arguments(p)
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("bench-one-batch", help="decode of one static batch: ms/step vs the "
                       "HBM roofline and HF transformers (after SGLang's bench_one_batch)")
    add_layout_flags(p)
    from cpmoe.bench.one_batch_run import add_arguments as add_one_batch_arguments
    add_one_batch_arguments(p)
    add_engine_flags(p, "what the largest batch needs")
    p.set_defaults(fn=cmd_bench_one_batch)
    p = sub.add_parser("bench-serving", help="online serving throughput and latency over "
                       "HTTP streaming (after sglang.bench_serving)")
    from cpmoe.bench.serving import add_arguments as add_serving_arguments
    add_serving_arguments(p)
    p.set_defaults(fn=cmd_bench_serving)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit 0; 2 after one `cpmoe: error:` line for bad input (checked before any rank, or
    raised on a rank); 1 after a rank failed (its error); 130 on Ctrl-C (ranks stopped).
    Under torchrun every process runs this: input checked before the ranks meet is the same
    on all of them, so only rank 0 prints it; a peer that lost its partner prints one line."""
    args = build_parser().parse_args(argv)
    rank = torchrun_rank()
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        if not rank:
            print(f"cpmoe: error: {e}", file=sys.stderr)
        else:  # torchrun stops the others when one exits: let rank 0 print first
            time.sleep(TORCHRUN_QUIET_EXIT_S)
        return 2
    except RankFailure as e:
        if isinstance(e.error, USER_ERRORS):  # the same line and exit code as on one rank
            print(f"cpmoe: error: {e.error}", file=sys.stderr)
            return 2
        lost = peer_loss(e.error) if rank is not None else None
        if lost:
            print(f"cpmoe: rank {rank} stopped: a peer rank left the job ({lost}); the root "
                  f"error is in that rank's output", file=sys.stderr)
            return 1
        print(f"cpmoe: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a pool has killed its ranks on the way out
        print("cpmoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
