"""Tile sweep of the skinny FP8 GEMM (`fp8_gemm.fp8_linear_skinny`) against F.scaled_mm, the
decode step's dense FP8 projections, on the GPU.

    python3 -m bench.fp8_linear --out bench/results/fp8-linear.json

At Qwen3-30B-A3B's attention shapes (fused q/k/v 2048 -> 5120, o_proj 4096 -> 2048), FP8
weights with one float32 scale per 128 x 128 block and bf16 rows, for 1, 16, 32 and 64 rows:
- "scaled_mm": F.scaled_mm alone on rows quantized ahead (padded to 16 rows, as
  `fp8_linear` pads them), and "quantize+scaled_mm": `quantize_act` and F.scaled_mm, all
  of fp8_linear's work past SKINNY_ROWS rows;
- "skinny default": `quantize_act` and `fp8_linear_skinny` with `skinny_config`'s tiles
  (what fp8_linear runs up to SKINNY_ROWS rows), and the same under every tile of the sweep
  (BLOCK_N, SPLIT_K, warps, stages; `--tiles` for another grid), the split K's sum of
  partials included;
- the HBM floor: the FP8 weight bytes at the card's datasheet HBM bandwidth.
Time per call in microseconds from a CUDA graph replay (`decode_kernels.time_us`, as the
decode step replays them); 8 weight copies are rotated, so no call finds its weights in the
50 MB L2. Prints one table (a column per shape and row count, * the column's fastest
skinny tile) and writes every time to JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.decode_kernels import parse_tiles, time_us
from cpmoe.bench.one_batch import hbm_bytes_per_s
from cpmoe.bench.provenance import provenance
from cpmoe.ops import fp8, fp8_gemm

SHAPES = (("qkv", 5120, 2048), ("o_proj", 2048, 4096))  # (name, N, K)
COPIES = 8  # 8 x 8-10 MB of FP8 weights, past the L2
HBM_BYTES_PER_S = hbm_bytes_per_s(torch.cuda.get_device_name() if torch.cuda.is_available()
                                  else "cpu")
GRID = [(bn, split, warps, stages) for bn, split, (warps, stages) in itertools.product(
    (32, 64, 128), (1, 2, 4), ((4, 3), (4, 5)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,32,64",
                    help=f"row counts, each at most fp8_gemm.SKINNY_ROWS "
                         f"({fp8_gemm.SKINNY_ROWS})")
    ap.add_argument("--tiles", help="the grid instead of the built-in one: BLOCK_N:SPLIT_K:"
                    "warps:stages, comma-separated (e.g. 64:8:4:3,32:16:4:5)")
    args = ap.parse_args()
    grid = parse_tiles(args.tiles, "BLOCK_N:SPLIT_K:warps:stages") if args.tiles else GRID
    torch.manual_seed(0)
    table: dict[str, dict[str, float]] = {}  # row label -> column -> us
    results = []
    columns = []
    for name, N, K in SHAPES:
        ws = [torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn) for _ in range(COPIES)]
        scales = [torch.rand(N // 128, K // 128, device="cuda") + 0.5 for _ in range(COPIES)]
        mm_scales = [fp8_gemm.scaled_mm_weight_scale(s) for s in scales]
        floor = N * K / HBM_BYTES_PER_S * 1e6
        for rows in [int(r) for r in args.rows.split(",")]:
            col = f"{name} x{rows}"
            columns.append(col)
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            padded = -(-rows // fp8_gemm.SCALED_MM_ROWS) * fp8_gemm.SCALED_MM_ROWS
            xq, xs = fp8.quantize_act(x, 128, padded)

            def scaled_mm(i, q=xq, s=xs):
                return F.scaled_mm(q, ws[i % COPIES].t(), s, F.ScalingType.BlockWise1x128,
                                   mm_scales[i % COPIES], F.ScalingType.BlockWise128x128,
                                   output_dtype=torch.bfloat16)

            def quantized_mm(i, x=x, padded=padded):
                q, s = fp8.quantize_act(x, 128, padded)
                return scaled_mm(i, q, s)

            def skinny(cfg, x=x):
                def fn(i):
                    q, s = fp8.quantize_act(x, 128)
                    return fp8_gemm.fp8_linear_skinny(q, s, ws[i % COPIES], scales[i % COPIES],
                                                     config=cfg)
                return fn

            default = fp8_gemm.skinny_config(rows, N, K)
            timed = {"scaled_mm": scaled_mm, "quantize+scaled_mm": quantized_mm,
                     "skinny default": skinny(default)}
            for label, fn in timed.items():
                table.setdefault(label, {})[col] = t = time_us(fn)
                results.append({"shape": name, "N": N, "K": K, "rows": rows, "path": label,
                                "us": t, **(default if label == "skinny default" else {})})
            for tile in grid:
                bn, split, warps, stages = tile
                cfg = dict(BLOCK_N=bn, SPLIT_K=split, num_warps=warps, num_stages=stages)
                try:
                    t = time_us(skinny(cfg))
                except Exception as e:  # noqa: BLE001 - a tile that does not fit: skip it
                    print(f"{col} {cfg}: {type(e).__name__}", file=sys.stderr)
                    continue
                table.setdefault(" ".join(map(str, tile)), {})[col] = t
                results.append({"shape": name, "N": N, "K": K, "rows": rows,
                                "path": "skinny", "us": t, **cfg})
            table.setdefault("HBM floor", {})[col] = floor
            results.append({"shape": name, "N": N, "K": K, "rows": rows, "hbm_floor_us": floor})
            print(f"{col}: skinny default {table['skinny default'][col]:.1f} us, "
                  f"quantize+scaled_mm {table['quantize+scaled_mm'][col]:.1f} us",
                  file=sys.stderr, flush=True)
            write(args.out, results, complete=False)  # a sweep cut off keeps its columns
        del ws
    write(args.out, results, complete=True)
    print_table(table, columns, grid)


def write(path: str, results: list[dict], complete: bool) -> None:
    """The JSON of the sweep so far; complete: every shape and row count was timed (a pick
    of tiles by both shapes needs it, `bench.tuned_tiles`)."""
    with open(path, "w") as f:
        json.dump({"header": provenance(sys.argv), "complete": complete, "results": results},
                  f, indent=1)


def print_table(table: dict[str, dict[str, float]], columns: list[str],
                grid: list[tuple[int, ...]]) -> None:
    """A line per path or skinny tile ("BLOCK_N SPLIT_K warps stages"), a column per shape
    and row count, in us per call; * marks each column's fastest skinny tile."""
    tiles = {" ".join(map(str, tile)) for tile in grid}
    best = {c: min((table[t][c] for t in tiles if c in table[t]), default=None)
            for c in columns}
    print("| path or tile (BLOCK_N SPLIT_K warps stages) | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for label, us in table.items():
        print(f"| {label} | " + " | ".join(
            f"{us[c]:.1f}{'*' if label in tiles and us[c] == best[c] else ''}" if c in us
            else "-" for c in columns) + " |")


if __name__ == "__main__":
    main()
