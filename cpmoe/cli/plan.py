"""`cpmoe plan`: sizes, groups, per-layer token layouts and memory per rank of a layout, with
no process started and no weight read."""

from __future__ import annotations

import argparse
import json

from cpmoe import communicator
from cpmoe.cli.flags import InputError, resolve
from cpmoe.engine.sizing import with_quantization
from cpmoe.models.registry import load_model_config


def cmd_plan(args: argparse.Namespace) -> int:
    from cpmoe.estimate.command import run_estimate, stray_estimate_flag
    if args.estimate:  # the cost model over layouts (cpmoe/estimate/)
        return run_estimate(args)
    if stray_estimate_flag(args):
        raise InputError(stray_estimate_flag(args))
    from cpmoe.engine.sizing import kv_cache_refusal, memory_per_rank
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
