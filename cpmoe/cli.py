"""`cpmoe` command line: plan / prefill / generate / check.

Everything a user can get wrong (layout flags, model fit, input files) is checked in the
parent process before any rank is spawned; a failure prints one line and exits 2 without
writing output. A failing rank ends the whole job (exit 1) with its error shown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from cpmoe import communicator as cm
from cpmoe.config import ConfigError, parse_dtype
from cpmoe.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from cpmoe.engine.kv_cache import CacheFullError
from cpmoe.engine.runner import check_model_fit
from cpmoe.loader import LoadError
from cpmoe.models.registry import load_model_config
from cpmoe.moe.dispatch.base import MissingBackendError, check_backend_available
from cpmoe.parallel.launch import RankFailure, launch
from cpmoe.parallel.layout import BACKENDS, CP_STRATEGIES, LayoutError, ParallelLayout


class InputError(ValueError):
    """Bad user input other than layout/config; one line naming the flag or file."""


USER_ERRORS = (LayoutError, ConfigError, LoadError, InputError, MissingBackendError,
               CacheFullError)


def add_layout_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel layout (SGLang flags)")
    g.add_argument("--tp-size", type=int, default=1, help="ranks of one model replica")
    g.add_argument("--attn-cp-size", type=int, default=1, help="attention context parallel")
    g.add_argument("--moe-dp-size", type=int, default=1, help="MoE data parallel (1 or CP)")
    g.add_argument("--ep-size", type=int, default=1, help="MoE expert parallel")
    g.add_argument("--moe-a2a-backend", default="none", choices=BACKENDS)
    g.add_argument("--cp-strategy", default="zigzag", choices=CP_STRATEGIES)
    g.add_argument("--dp-size", type=int, default=1, help="attention data parallel (only 1)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help=f"HF checkpoint directory (default: built-in {DEFAULT_MODEL_NAME})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available")
    p.add_argument("--dtype", default=None, help="float32|bfloat16|float16 "
                   "(default: float32 on cpu, bfloat16 on cuda)")


def layout_from_args(args: argparse.Namespace) -> ParallelLayout:
    if args.dp_size != 1:
        raise LayoutError(f"--dp-size {args.dp_size}: attention data parallelism is not "
                          f"supported (use --attn-cp-size)")
    layout = ParallelLayout(tp_size=args.tp_size, attn_cp_size=args.attn_cp_size,
                            moe_dp_size=args.moe_dp_size, ep_size=args.ep_size,
                            moe_a2a_backend=args.moe_a2a_backend, cp_strategy=args.cp_strategy)
    check_backend_available(layout.moe_a2a_backend)
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
    return layout, model_dir, cfg, device, dtype


# ---- commands ---------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    layout, model_dir, cfg, _, _ = resolve(args)
    out = layout.summary()
    sparse = [cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)]
    out["layer_modes"] = [{"layer": p.layer, "sparse": p.sparse, "attn": p.attn.value,
                           "mlp": p.mlp.value} for p in cm.plan_layers(layout, sparse)]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"model: {model_dir} ({cfg.architecture})")
    print("sizes: " + ", ".join(f"{k}={v}" for k, v in out.items()
                                if k not in ("groups", "layer_modes")))
    for kind, members in out["groups"].items():
        print(f"  {kind:<8} " + " ".join(str(m) for m in members))
    modes: dict[tuple[str, str], list[int]] = {}
    for m in out["layer_modes"]:
        modes.setdefault((m["attn"], m["mlp"]), []).append(m["layer"])
    for (attn, mlp), layers in modes.items():
        print(f"  layers {layers}: attention {attn}, mlp {mlp}")
    return 0


def read_id_batch(path: Path, vocab_size: int) -> list[list[int]]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"--input-ids-file {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"--input-ids-file {path}: not JSON ({e.msg} at line {e.lineno})") \
            from None
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

    from cpmoe.engine.tasks import RunSpec, prefill_task
    layout, model_dir, cfg, device, dtype = resolve(args)
    seqs = read_id_batch(args.input_ids_file, cfg.vocab_size)
    out_path = Path(args.dump_logits)
    if not out_path.parent.is_dir():
        raise InputError(f"--dump-logits {out_path}: folder {out_path.parent} does not exist")
    spec = RunSpec(model_dir, layout, dtype)
    logits = launch(prefill_task, layout.world_size, device, spec, seqs)
    if logits is None:  # a non-zero torchrun rank
        return 0
    tmp = out_path.with_name(out_path.name + ".tmp")
    save_file({f"logits.{i}": t.float().contiguous() for i, t in enumerate(logits)}, str(tmp))
    os.replace(tmp, out_path)
    print(f"wrote logits of {len(seqs)} sequence(s) to {out_path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from cpmoe.engine.tasks import RunSpec, generate_task
    layout, model_dir, cfg, device, dtype = resolve(args)
    tokenizer = _tokenizer(model_dir)
    if args.input_ids is not None:
        try:
            ids = [int(t) for t in args.input_ids.split(",")]
        except ValueError:
            raise InputError(f"--input-ids {args.input_ids!r}: expected comma-separated "
                             f"integers") from None
    elif tokenizer is None:
        raise InputError(f"--prompt: {model_dir} has no tokenizer; pass --input-ids")
    else:
        ids = tokenizer.encode(args.prompt)
    check_ids(ids, cfg.vocab_size, "--input-ids" if args.input_ids else "--prompt")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    spec = RunSpec(model_dir, layout, dtype)
    out = launch(generate_task, layout.world_size, device, spec, [ids], args.max_new_tokens,
                 cfg.eos_token_ids)
    if out is None:
        return 0
    print(tokenizer.decode(out[0]) if tokenizer is not None and args.input_ids is None
          else ",".join(map(str, out[0])))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from cpmoe.engine.tasks import RunSpec, check_task
    layout, model_dir, cfg, device, dtype = resolve(args)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise InputError(f"--lengths {args.lengths!r}: expected comma-separated integers") \
            from None
    if args.prompts < 1 or not lengths or min(lengths) < 1:
        raise InputError(f"--prompts {args.prompts} and --lengths {args.lengths} must be "
                         f"positive")
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
    report = launch(check_task, layout.world_size, device, RunSpec(model_dir, layout, dtype),
                    batches)
    if report is None:
        return 0
    print(f"layout: {json.dumps({k: v for k, v in layout.summary().items() if k != 'groups'})}")
    print(f"first-token matches: {report.matches}/{report.prompts}")
    print(f"max |logit diff|: {report.max_abs_diff:.3e}")
    print(f"mean top-1 log-prob delta: {report.mean_logprob_delta:.3e}")
    if report.mismatched:
        print(f"mismatched prompts: {report.mismatched}")
    return 0 if report.matches == report.prompts else 1


def _tokenizer(model_dir: Path):
    if not (model_dir / "tokenizer.json").exists() and \
            not (model_dir / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print sizes, groups and per-layer token layouts")
    add_layout_flags(p)
    add_model_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("prefill", help="prefill a batch and dump all-position logits")
    add_layout_flags(p)
    add_model_flags(p)
    p.add_argument("--input-ids-file", type=Path, required=True)
    p.add_argument("--dump-logits", type=Path, required=True)
    p.set_defaults(fn=cmd_prefill)
    p = sub.add_parser("generate", help="greedy generation")
    add_layout_flags(p)
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--input-ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("check", help="compare a layout against the one-rank reference")
    add_layout_flags(p)
    add_model_flags(p)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--lengths", default="17,64,129")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.set_defaults(fn=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"cpmoe: error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        kind = e.summary.split(": ", 2)
        if len(kind) == 3 and kind[1] in {c.__name__ for c in USER_ERRORS}:
            print(f"cpmoe: error: {kind[2]} ({kind[0]})", file=sys.stderr)
            return 2
        print(f"cpmoe: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
