"""`cpmoe prefill`, `generate` and `check`: input read and checked in the parent, then the
ranks launched once (`parallel/launch.py`) on the rank tasks of `engine/rank_tasks.py`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from cpmoe.cli.flags import (InputError, check_context, context_from_args, engine_options,
                             resolve, tokenizer_of)
from cpmoe.config import read_json_file
from cpmoe.default_model import DEFAULT_MODEL_NAME
from cpmoe.parallel.launch import launch


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
    from cpmoe.cp.kv_capacity import kv_slots_needed, over_capacity
    from cpmoe.engine.sampling import SamplingParams
    from cpmoe.engine.rank_tasks import RunSpec, generate_task
    layout, model_dir, cfg, device, dtype = resolve(args)
    opts = engine_options(args, cfg)
    tokenizer = tokenizer_of(model_dir)
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
