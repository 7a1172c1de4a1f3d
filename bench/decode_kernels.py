"""Tile sweep of the decode experts' GEMM kernel (cpmoe/moe/fused_moe.py) on the GPU.

    python3 -m bench.decode_kernels --out bench/results/decode-kernels.json
    python3 -m bench.decode_kernels --fp8 --out bench/results/decode-kernels-fp8.json

(A Triton skinny GEMM for the dense projections was swept against cuBLAS the same way and
lost: bench/results/decode-dense-20261202.json, code at commit 23687c9.)

At Qwen3-30B-A3B's expert shape (128 experts, hidden 2048, intermediate 768, top-8) and
uniform routing, for 1, 16, 64 and 256 rows: the gate/up and down GEMMs under every tile
configuration of the sweep, against `gemm_config`'s choice. Weights of several layers are
rotated so no repetition finds a previous one's experts in L2. Prints a table per GEMM and
writes every time to JSON; time in microseconds per call, CUDA events over a graph replay.
--fp8: the weights in float8_e4m3fn with one float32 scale per 128 x 128 block, as
`--quantization fp8` serves them (tiles then stay inside one block: BLOCK_N, BLOCK_K <= 128).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from cpmoe.bench.provenance import provenance
from cpmoe.moe import fused_moe

E, H, I, TOP_K = 128, 2048, 768, 8
LAYERS = 6  # weight copies rotated through (6 x 1.2 GB, far past the 50 MB L2)


def routed(rows: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(rows)]).cuda()


def time_us(fn, reps: int = 48) -> float:
    """Per call, from a CUDA graph of `reps` calls (as the decode step replays them: no
    launch overhead from Python, which exceeds these kernels' own time at batch 1)."""
    fn(0)  # compile
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(3):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000 / (3 * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights with 128 x 128 scales")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    wdtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16

    def weights(rows: int, cols: int) -> list[torch.Tensor]:
        return [(torch.randn(E, rows, cols, device="cuda") * 0.02).to(wdtype)
                for _ in range(LAYERS)]

    def scales(rows: int, cols: int) -> list[torch.Tensor | None]:
        return [torch.rand(E, rows // 128, cols // 128, device="cuda") + 0.5 if args.fp8
                else None for _ in range(LAYERS)]

    gate_up, down = weights(2 * I, H), weights(H, I)
    gate_up_s, down_s = scales(2 * I, H), scales(H, I)
    if args.fp8:  # a tile must stay inside one 128 x 128 scale block
        grid = [(bn, bk, w, s) for bn, bk, (w, s) in itertools.product(
            (32, 64, 128), (64, 128), ((4, 3), (4, 5), (4, 7), (8, 4), (8, 6)))]
    else:
        grid = [(bn, bk, w, s) for bn, bk, (w, s) in itertools.product(
            (16, 32, 64), (64, 128, 256), ((4, 3), (4, 5), (8, 4)))]
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        ids = routed(rows, gen)
        P = rows * TOP_K
        x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
        slots = torch.empty(E, P, dtype=torch.int32, device="cuda")
        counts = torch.empty(E, dtype=torch.int32, device="cuda")
        fused_moe._align_kernel[(E,)](ids.reshape(-1), slots, counts, P, P,
                                      BLOCK_P=min(1024, fused_moe._pow2(P)))
        act = torch.randn(P, I, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(P, H, device="cuda", dtype=torch.bfloat16)
        out_act = torch.empty(P, I, device="cuda", dtype=torch.bfloat16)
        for name, a, ws, ss, out, gated, N, k_dim in (
                ("gate_up", x, gate_up, gate_up_s, out_act, True, I, H),
                ("down", act, down, down_s, y, False, H, I)):
            default = fused_moe.gemm_config(P, E, k_dim, fp8=args.fp8)

            def run(cfg):
                return lambda i: fused_moe._gemm(a, ws[i % LAYERS], slots, counts, out, TOP_K,
                                                 row_of_slot=gated, gated=gated, config=cfg,
                                                 scale=ss[i % LAYERS])
            base = time_us(run(default))
            best = (base, default)
            for bn, bk, warps, stages in grid:
                if bk > k_dim:
                    continue
                cfg = dict(default, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                           num_stages=stages)
                try:
                    t = time_us(run(cfg))
                except Exception as e:  # noqa: BLE001 - a tile that does not fit: skip it
                    print(f"{name} rows {rows} {cfg}: {type(e).__name__}")
                    continue
                results.append({"gemm": name, "rows": rows, "us": t, **cfg})
                if t < best[0]:
                    best = (t, cfg)
            ideal = (len(torch.unique(ids)) * N * (2 if gated else 1) * k_dim
                     * wdtype.itemsize / 4.8e12 * 1e6)
            print(f"{name:8s} rows {rows:4d}: default {base:7.1f} us {default} | best "
                  f"{best[0]:7.1f} us {best[1]} | HBM floor {ideal:6.1f} us", flush=True)
            results.append({"gemm": name, "rows": rows, "us": base, "default": True,
                            "hbm_floor_us": ideal, **default})
    with open(args.out, "w") as f:
        json.dump({"header": provenance(sys.argv), "fp8": args.fp8, "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
