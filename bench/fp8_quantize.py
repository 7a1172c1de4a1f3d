"""Tile sweep of the FP8 activation quantizer (`fp8.quantize_act`) on the GPU.

    python3 -m bench.fp8_quantize --out bench/results/fp8-quantize.json

bf16 rows [M, K] -> e4m3 values [M, K] and float32 scales per row and 128 inputs, at the
prefill shapes of Qwen3-30B-A3B's FP8 layers (16K tokens: hidden 2048 and the 4096 of
attention's output; 128K slots of the experts' 768 intermediate, 8 per token, and 128K
rows of hidden) and decode's (64 rows; 64 x 8 expert slots of 768). Each shape runs
`quantize_config`'s default tile and every BLOCK_M x warps of the sweep; a call moves
2 + 1 bytes an input and 4 bytes a scale, printed as GB/s and as a share of the card's
datasheet HBM peak (`cpmoe.bench.one_batch.hbm_bytes_per_s`). Time per call from CUDA events
over back-to-back calls (`cpmoe.bench.timing.cuda_ms`), so decode's figures are
launch-bound. Prints one table (a line per tile, a column per shape, * the column's fastest)
and writes every time to JSON.
Then, at the experts' intermediate (768) for 128K and 512 slots, the FP8 experts' SwiGLU +
quantization fused (`fp8.swiglu_quantize`) against `ops.silu_and_mul` + `quantize_act`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from cpmoe import ops
from cpmoe.bench.one_batch import hbm_bytes_per_s
from cpmoe.bench.provenance import provenance
from cpmoe.bench.timing import cuda_ms, sweep_ms
from cpmoe.ops import fp8

SHAPES = ((16384, 2048), (16384, 4096), (131072, 768), (131072, 2048), (64, 2048),
          (64, 4096), (64 * 8, 768))  # (M, K)
GRID = {"BLOCK_M": (1, 2, 4, 8, 16, 32, 64), "num_warps": (1, 2, 4, 8)}
HBM_BYTES_PER_S = hbm_bytes_per_s(torch.cuda.get_device_name() if torch.cuda.is_available()
                                  else "cpu")
GROUP = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.fp8_quantize needs a CUDA GPU")
    torch.manual_seed(0)
    table: dict[str, dict[str, float]] = {}  # tile -> column -> GB/s
    results, columns = [], []
    for M, K in SHAPES:
        col = f"{M}x{K}"
        columns.append(col)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        moved = M * K * 3 + M * (K // GROUP) * 4
        default = fp8.quantize_config(M)

        def call(**cfg):
            return lambda: fp8.quantize_act(x, GROUP, config=cfg)

        ms = cuda_ms(call(**default), args.iters)
        gbs = moved / ms / 1e6
        table.setdefault("default", {})[col] = gbs
        results.append({"M": M, "K": K, "tile": "default", **default, "ms": ms, "gb_s": gbs})
        print(f"{col}: default {default} {ms * 1e3:.1f} us, {gbs:.0f} GB/s "
              f"({gbs * 1e9 / HBM_BYTES_PER_S:.0%} of HBM)", file=sys.stderr, flush=True)
        for r in sweep_ms(call, GRID, moved, args.iters, unit="tbs", show=3):
            table.setdefault(f"{r['BLOCK_M']} {r['num_warps']}", {})[col] = r["tbs"] * 1e3
            results.append({"M": M, "K": K, "tile": "sweep", "BLOCK_M": r["BLOCK_M"],
                            "num_warps": r["num_warps"], "ms": r["ms"],
                            "gb_s": r["tbs"] * 1e3})
        results.append({"M": M, "K": K, "hbm_floor_ms": moved / HBM_BYTES_PER_S * 1e3})
        del x
    print_table(table, columns)
    results += swiglu_rows(args.iters)
    with open(args.out, "w") as f:
        json.dump({"header": provenance(sys.argv), "results": results}, f, indent=1)


def swiglu_rows(iters: int, slots: tuple[int, ...] = (131072, 512)) -> list[dict]:
    """Fused and unfused SwiGLU + quantization of packed [P, 2 x 768] bf16 gate/up rows;
    the fused one reads 4 bytes an output and writes 1 (+ scales)."""
    rows = []
    for P in slots:
        h = torch.randn(P, 2 * 768, device="cuda", dtype=torch.bfloat16)
        moved = P * 768 * 5 + P * 6 * 4
        for path, fn in (("fused", lambda: fp8.swiglu_quantize(h, GROUP)),
                         ("silu_and_mul+quantize_act",
                          lambda: fp8.quantize_act(ops.silu_and_mul(h), GROUP))):
            ms = cuda_ms(fn, iters)
            gbs = moved / ms / 1e6  # the fused kernel's bytes, for both
            print(f"swiglu {P}x768 {path}: {ms * 1e3:.1f} us ({gbs:.0f} GB/s of the fused "
                  f"bytes, {gbs * 1e9 / HBM_BYTES_PER_S:.0%} of HBM)")
            rows.append({"swiglu_rows": P, "I": 768, "path": path, "ms": ms, "gb_s": gbs})
        del h
    return rows


def print_table(table: dict[str, dict[str, float]], columns: list[str]) -> None:
    """A line per tile ("BLOCK_M warps", or the default), a column per shape, in GB/s and
    the share of the HBM peak; * marks each column's fastest tile."""
    best = {c: max(v[c] for v in table.values() if c in v) for c in columns}
    print("| tile (BLOCK_M warps) | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label, gbs in table.items():
        print(f"| {label} | " + " | ".join(
            f"{gbs[c]:.0f} ({gbs[c] * 1e9 / HBM_BYTES_PER_S:.0%}){'*' if gbs[c] == best[c] else ''}"
            if c in gbs else "-" for c in columns) + " |")


if __name__ == "__main__":
    main()
