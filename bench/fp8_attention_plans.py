"""cuDNN's execution plans for cpmoe's FP8 prefill attention graph, each timed on the GPU.

    python3 -m bench.fp8_attention_plans [--lengths 16384,131072] [--out FILE.json]

cpmoe builds its `sdpa_fp8` graph (`cp.fp8_attention.operation_graph`) with heuristic A
and runs the first plan that builds (`_build`). This builds the same graph at Qwen3-30B-A3B's
heads (32 query, 4 KV, head 128; one causal prompt of each length) with heuristics A, B and
FALLBACK, builds every plan the list holds, and times each on the same e4m3 inputs (CUDA
events), for the graph with the padding mask (what cpmoe runs: the real lengths from device
tensors) and without it (the graph's lengths are the real ones). Each plan's O codes are
compared with those of cpmoe's own call (largest difference over O's largest magnitude).
Prints a line per plan (name, ms, TFLOP/s, speed against cpmoe's call) and writes them to
JSON. The FLOPs of a causal prompt of n: 2 n^2 D H (Q.K^T and P.V over the lower triangle).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from cpmoe.bench.provenance import provenance
from cpmoe.bench.timing import cuda_ms
from cpmoe.cp import fp8_attention as fa

HEADS, KV_HEADS, DIM = 32, 4, 128


def _flops(n: int) -> float:
    """A causal prompt of n: Q.K^T and P.V over the lower triangle."""
    return 2.0 * n * n * DIM * HEADS


def _inputs(n: int) -> tuple:
    """Random 16-bit q, k, v quantized as cpmoe does (`fp8_attention.quantize`)."""
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(n, h, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    return fa.quantize(q, n), fa.quantize(k, n), fa.quantize(v, n)


def _timed(run, budget_ms: float = 300.0) -> float:
    """ms per run: one untimed call, a timed one, then as many as fit the budget (2-20)."""
    first = cuda_ms(run, iters=1)
    return cuda_ms(run, iters=max(2, min(20, int(budget_ms / max(first, 1e-3)))))


def _cpmoe_call(n: int, scale: float, q8, k8, v8) -> tuple[float, torch.Tensor, str]:
    """cpmoe's own graph and plan (`_build`, as `fp8_attention_e4m3` runs it)."""
    dev = torch.device("cuda")
    built = fa._build(dev, n, n, HEADS, KV_HEADS, DIM, True, False, scale)
    o8 = torch.empty(n, HEADS, DIM, dtype=torch.float8_e4m3fn, device=dev)
    pack = fa.variant_pack(built.tensors, q8, k8, v8, o8, v8[1] / fa._O_HEADROOM, n, n, None)
    handle = fa._handle(dev)
    ms = _timed(lambda: built.graph.execute(pack, built.workspace, handle=handle))
    index = getattr(built.graph, "_plan_index", None)
    name = built.graph.get_plan_name_at_index(index) if index is not None else "?"
    return ms, o8.clone(), name


def _plans(n: int, scale: float, padding: bool, q8, k8, v8, ref: torch.Tensor,
           base_ms: float) -> list[dict]:
    import cudnn

    dev = torch.device("cuda")
    g, t = fa.operation_graph(n, n, HEADS, KV_HEADS, DIM, True, False, scale, padding=padding)
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    count = g.get_execution_plan_count()
    flops = _flops(n)
    rows = []
    for i in range(count):
        row = {"length": n, "padding": padding, "index": i}
        try:
            row["name"] = g.get_plan_name_at_index(i)
            g.build_plan_at_index(i)
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8,
                             device=dev)
            o8 = torch.zeros(n, HEADS, DIM, dtype=torch.float8_e4m3fn, device=dev)
            pack = fa.variant_pack(t, q8, k8, v8, o8, v8[1] / fa._O_HEADROOM, n, n, None)
            handle = fa._handle(dev)
            ms = _timed(lambda: g.execute_plan_at_index(pack, ws, index=i, handle=handle))
        except Exception as e:  # a plan that does not build or run: reported, not hidden
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
            print(f"  padding={padding!s:5} plan {i:2} {row.get('name', '?')}: {row['error']}")
            rows.append(row)
            continue
        diff = ((o8.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        row.update(ms=ms, tflops=flops / ms / 1e9, speed=base_ms / ms, o_diff=diff)
        print(f"  padding={padding!s:5} plan {i:2} {row['name'][:70]:70} {ms:9.3f} ms "
              f"{row['tflops']:6.0f} TFLOP/s {row['speed']:6.3f}x  O diff {diff:.4f}")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="16384,131072",
                    help="prompt lengths, comma-separated (default 16384,131072)")
    ap.add_argument("--out", help="JSON with every plan's row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.fp8_attention_plans needs a CUDA GPU")
    hint = fa.install_hint()
    if hint:
        sys.exit(hint)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        sys.exit(f"--lengths: expected comma-separated integers, got {args.lengths!r}")
    scale = DIM ** -0.5
    results = []
    for n in lengths:
        if n != fa.bucket(n):
            sys.exit(f"--lengths: expected powers of two >= 128 (a graph's bucket), got {n}")
        q8, k8, v8 = _inputs(n)
        base_ms, ref, name = _cpmoe_call(n, scale, q8, k8, v8)
        print(f"length {n}: cpmoe's call {base_ms:.3f} ms, {_flops(n) / base_ms / 1e9:.0f} "
              f"TFLOP/s, plan {name}")
        results.append({"length": n, "cpmoe": True, "name": name, "ms": base_ms})
        for padding in (True, False):
            results += _plans(n, scale, padding, q8, k8, v8, ref, base_ms)
        del q8, k8, v8, ref
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": provenance(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
