"""Tile and split sweep of paged decode attention (cpmoe/cp/paged_attention.py) on the GPU.

    python3 -m bench.decode_attention --out bench/results/decode-attention.json

At Qwen3-30B-A3B's attention shape (32 query / 4 KV heads, head 128, pages of 16 tokens,
each row's pages scattered over the pool) for each --shapes entry (rows x keys a row) and
each pool dtype (--dtypes: bf16 pools, or e4m3 pools with the layer's k/v scales as
`--kv-cache-dtype fp8_e4m3` serves them): every stage-1 tile of the grid (BLOCK_N keys a
tile, warps, pipeline stages, and PAGE_IDS: block-table entries read at a time, 0 or left
out: a tile's own; `--tiles` replaces it) under every split count of --splits,
against the defaults (`stage1_config`, `default_num_splits`). A time is all of the decode
attention's work in a step: stage 1, stage 2 where splits > 1, and with e4m3 pools the o_proj
rows' FP8 quantization, which the last stage does inside itself (`quant_group`: stage 2, or
stage 1 at one split). Layers' pools are rotated so no repetition finds the previous one's
pages in L2. Each output is checked against the float32 reference once per tile.

Prints a table per (dtype, shape): a line per tile, a column per split count, the fastest
marked *, and the K/V bytes' floor at the device-to-device copy rate measured in the same
process. Writes every time to JSON; microseconds per call, CUDA events over a graph replay.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.decode_kernels import parse_tiles, time_us
from cpmoe.bench.provenance import provenance
from cpmoe.cp import paged_attention as pa
from cpmoe.ops.fp8 import quantize_act

H, HKV, D, PAGE = 32, 4, 128, 16
LAYERS = 3  # pools rotated through (3 x 0.3-0.7 GB, past the 50 MB L2)
GRID = "32:2:2,32:4:2,64:4:2,64:4:3,64:8:2,128:8:2,128:8:3"


def copy_rate() -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write), the floor's rate."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (time_us(lambda i: b.copy_(a), reps=8) * 1e-6)


def pools(B: int, keys: int, dtype: torch.dtype, gen: torch.Generator):
    """LAYERS (k, v) pools of B rows x `keys` tokens, one block table of scattered pages."""
    per_row = -(-keys // PAGE)
    pages = B * per_row
    table = torch.randperm(pages, generator=gen).view(B, per_row).to(torch.int32).cuda()
    layers = []
    for _ in range(LAYERS):
        k, v = (torch.randn(pages, PAGE, HKV, D, device="cuda") for _ in range(2))
        layers.append((k.to(dtype), v.to(dtype)))
    return layers, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="64x1088,128x1280",
                    help="rows x keys a row, comma-separated")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    ap.add_argument("--tiles", default=GRID,
                    help="BLOCK_N:warps:stages[:page_ids], comma-separated")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        splits = [int(s) for s in args.splits.split(",")]
    except ValueError:
        sys.exit(f"--shapes / --splits: expected e.g. 64x1088 / 1,2,4, got {args.shapes!r} / "
                 f"{args.splits!r}")
    grid = parse_tiles(args.tiles, "BLOCK_N:warps:stages:page_ids", optional=1)
    rate = copy_rate()
    print(f"device-to-device copy: {rate / 1e12:.2f} TB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in args.dtypes.split(","):
        fp8 = name == "fp8"
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        kv_scale = torch.tensor([0.02, 0.03, 50.0, 33.3], device="cuda") if fp8 else None
        for B, keys in shapes:
            layers, table = pools(B, keys, dtype, gen)
            lens = torch.full((B,), keys, dtype=torch.int32, device="cuda")
            q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
            k0, v0 = layers[0]
            want, _ = pa.paged_decode_attention_ref(q.float(), k0, v0, table, lens,
                                                    D ** -0.5, kv_scale)

            def run(cfg, s):
                def step(i):
                    k, v = layers[i % LAYERS]
                    o, _ = pa.paged_decode_attention(q, k, v, table, lens, D ** -0.5,
                                                     num_splits=s, kv_scale=kv_scale,
                                                     quant_group=D if fp8 else None,
                                                     config=cfg)
                    if fp8:  # the o_proj's row quantization (the last stage's offer)
                        quantize_act(o.view(B, H * D), D)
                    return o
                return step

            floor = 2 * B * keys * HKV * D * dtype.itemsize / rate * 1e6
            default_s = pa.default_num_splits(B, HKV, table.shape[1], PAGE,
                                              pa._sm_count(q.device))
            table_us = {"default": {default_s: time_us(run(None, None))}}
            shape = {"rows": B, "keys": keys, "kv_heads": HKV, "page": PAGE,
                     "sms": pa._sm_count(q.device)}  # what `default_num_splits` reads
            results.append({"dtype": name, **shape, "default": True,
                            "splits": default_s, "us": table_us["default"][default_s],
                            "floor_us": floor, **pa.stage1_config(fp8, D)})
            for bn, warps, stages, page_ids in grid:
                cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
                       "PAGE_IDS": page_ids}
                try:
                    err = (run(cfg, 2)(0).float() - want).abs().max().item()
                except Exception as e:  # noqa: BLE001 - a tile that does not compile: skip it
                    print(f"{name} {B}x{keys} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if not err < 0.05:  # bf16 output of values ~N(0, 1/keys): far under 0.05
                    print(f"{name} {B}x{keys} {cfg}: max error {err:.3g}, left out")
                    continue
                for s in splits:
                    t = time_us(run(cfg, s))
                    table_us.setdefault((bn, warps, stages, page_ids), {})[s] = t
                    results.append({"dtype": name, **shape, "splits": s,
                                    "us": t, "max_err": err, **cfg})
            print_table(f"{name} pools, {B} rows x {keys} keys (K/V floor {floor:.1f} us at "
                        f"the copy rate; default {default_s} splits)", table_us, splits)
            del layers
            # written after every table: a sweep cut off by a time limit keeps its tables
            with open(args.out, "w") as f:
                json.dump({"header": provenance(sys.argv), "copy_rate": rate,
                           "results": results}, f, indent=1)


def print_table(title: str, table: dict, splits: list[int]) -> None:
    best = min(t for row in table.values() for t in row.values())
    print(f"{title}, us per call:")
    print(f"{'BLOCK_N warps stages ids':>26s}" + "".join(f"{s:>9d}" for s in splits))
    for tile, row in table.items():
        if tile == "default":
            (s, t), = row.items()
            print(f"{'default':>26s} {t:8.1f}{'*' if t == best else ' '} at {s} splits")
            continue
        print(" ".join(f"{v:>{w}d}" for v, w in zip(tile, (14, 5, 6, 3))) + "".join(
            f"{row[s]:8.1f}{'*' if row[s] == best else ' '}" if s in row else f"{'':>9s}"
            for s in splits), flush=True)

if __name__ == "__main__":
    main()
