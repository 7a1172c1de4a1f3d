"""Tile sweep of the decode experts' GEMM kernel (cpmoe/moe/fused_moe.py) on the GPU.

    python3 -m bench.decode_kernels --out bench/results/decode-kernels.json
    python3 -m bench.decode_kernels --fp8 --out bench/results/decode-kernels-fp8.json

(A Triton skinny GEMM for the dense projections was swept against cuBLAS the same way and
lost: bench/results/decode-dense-20261202.json, code at commit 23687c9.)

At Qwen3-30B-A3B's expert shape (128 experts, hidden 2048, intermediate 768, top-8) and
uniform routing, for 1, 16 and 64 rows: the gate/up and down GEMMs under every tile
configuration of the sweep, against `gemm_config`'s choice. Weights of several layers are
rotated so no repetition finds a previous one's experts in L2. Prints a table per GEMM and
writes every time to JSON; time in microseconds per call, CUDA events over a graph replay.
--fp8: the weights in float8_e4m3fn with one float32 scale per 128 x 128 block, as
`--quantization fp8` serves them, under each of `fused_moe.FP8_ACT_MODES` (--modes): a
column per mode, each mode's best marked *. A W8A8 time is all of that GEMM's work in a
decode step, the `quantize_act` launch of "w8a8" included. Tiles stay inside one scale
block, BLOCK_N <= 128; BLOCK_K 256 is two dots of 128. The FP8 grid leaves out what the
weights-only sweep at 721b0ce found slow or never best (BLOCK_K 64, BLOCK_N 128 on 4 warps,
BLOCK_N 32 on 8 warps, 5 or 7 stages on 4 warps, 6 on 8) and adds BLOCK_N 16 (more
programs at batch 1): 10 tiles a mode, so three modes take about the old sweep's 31 tiles
of compiling.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from cpmoe.bench.one_batch import hbm_bytes_per_s
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


def parse_tiles(text: str, fields: str, optional: int = 0) -> list[tuple[int, ...]]:
    """`--tiles`' comma-separated tiles of integers, one per colon-separated name of
    `fields` (its last `optional` ones may be left out: 0) -> tuples of every field;
    anything else exits with one line."""
    n = fields.count(":") + 1
    try:
        grid = [tuple(int(v) for v in t.split(":")) for t in text.split(",")]
    except ValueError:
        grid = []
    if not grid or any(not n - optional <= len(t) <= n for t in grid):
        sys.exit(f"--tiles: expected {fields}[,...], got {text!r}")
    return [t + (0,) * (n - len(t)) for t in grid]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights with 128 x 128 scales")
    ap.add_argument("--tiles", help="the grid instead of the built-in one: BLOCK_N:BLOCK_K:"
                    "warps:stages[:tma[:tiles[:quant_out]]], comma-separated (e.g. "
                    "64:128:4:5,128:128:4:4:1:2); tma 1: the weight tiles by TMA descriptor "
                    "(TMA_W), 0 or left out: by address; tiles: column tiles a program "
                    "(TILES, left out: 1); quant_out 1: gate/up writes FP8 rows and their "
                    "scales (QUANT_OUT, BLOCK_N 128; down's time still quantizes its rows: "
                    "the quantize_act line is what that saves)")
    ap.add_argument("--modes", default=",".join(fused_moe.FP8_ACT_MODES),
                    help="with --fp8: the activation modes swept")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    wdtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
    modes = args.modes.split(",") if args.fp8 else ["bf16"]  # bf16 weights: one column

    def weights(rows: int, cols: int) -> list[torch.Tensor]:
        return [(torch.randn(E, rows, cols, device="cuda") * 0.02).to(wdtype)
                for _ in range(LAYERS)]

    def scales(rows: int, cols: int) -> list[torch.Tensor | None]:
        return [torch.rand(E, rows // 128, cols // 128, device="cuda") + 0.5 if args.fp8
                else None for _ in range(LAYERS)]

    gate_up, down = weights(2 * I, H), weights(H, I)
    gate_up_s, down_s = scales(2 * I, H), scales(H, I)
    if args.fp8:
        grid = [(bn, bk, w, s, 0, 1, 0) for bk, (bn, w, s) in itertools.product(
            (128, 256), ((16, 4, 3), (32, 4, 3), (64, 4, 3), (64, 8, 4), (128, 8, 4)))]
    else:
        grid = [(bn, bk, w, s, 0, 1, 0) for bn, bk, (w, s) in itertools.product(
            (16, 32, 64), (64, 128, 256), ((4, 3), (4, 5), (8, 4)))]
    if args.tiles:
        grid = [t[:5] + (t[5] or 1, t[6]) for t in parse_tiles(
            args.tiles, "BLOCK_N:BLOCK_K:warps:stages:tma:tiles:quant_out", optional=3)]
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
        out_act8 = torch.empty(P, I, device="cuda", dtype=torch.float8_e4m3fn)
        out_act8_s = torch.empty(I // 128, P, device="cuda")
        for name, a, ws, ss, out, gated, N, k_dim in (
                ("gate_up", x, gate_up, gate_up_s, out_act, True, I, H),
                ("down", act, down, down_s, y, False, H, I)):
            def run(cfg):
                q = cfg.get("QUANT_OUT")
                return lambda i: fused_moe._gemm(
                    a, ws[i % LAYERS], slots, counts, out_act8 if q else out, TOP_K,
                    row_of_slot=gated, gated=gated, config=cfg, scale=ss[i % LAYERS],
                    out_scale=out_act8_s if q else None)
            table = {}  # (tile, or "default") -> {mode: us}
            for mode in modes:
                default = fused_moe.gemm_config(P, E, k_dim, fp8=args.fp8, fp8_act=mode,
                                                gated=gated)
                table.setdefault("default", {})[mode] = time_us(run(default))
                results.append({"gemm": name, "rows": rows, "mode": mode, "default": True,
                                "us": table["default"][mode], **default})
                for tile in grid:
                    bn, bk, warps, stages, tma, tiles, quant_out = tile
                    if bk > k_dim or (quant_out and not gated):
                        continue
                    cfg = dict(default, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                               num_stages=stages, TMA_W=bool(tma), TILES=tiles,
                               QUANT_OUT=bool(quant_out))
                    try:
                        t = time_us(run(cfg))
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit: skip it
                        print(f"{name} rows {rows} {mode} {cfg}: {type(e).__name__}")
                        continue
                    table.setdefault(tile, {})[mode] = t
                    print(f"  {name} {mode} {':'.join(map(str, tile))}: {t:.1f} us", flush=True)
                    results.append({"gemm": name, "rows": rows, "mode": mode, "us": t, **cfg})
            floor = (len(torch.unique(ids)) * N * (2 if gated else 1) * k_dim
                     * wdtype.itemsize / hbm_bytes_per_s(torch.cuda.get_device_name()) * 1e6)
            print_table(f"{name}, {rows} rows (HBM floor {floor:.1f} us)", table, modes)
            results.append({"gemm": name, "rows": rows, "hbm_floor_us": floor})
        if args.fp8:  # what a gate/up writing FP8 rows (QUANT_OUT) saves down: this launch
            q_us = time_us(lambda i: fused_moe.quantize_act(act, 128))
            print(f"quantize_act of down's {P} x {I} rows, {rows} rows: {q_us:.1f} us")
            results.append({"gemm": "quantize_act", "rows": rows, "us": q_us})
    with open(args.out, "w") as f:
        json.dump({"header": provenance(sys.argv), "fp8": args.fp8, "results": results}, f,
                  indent=1)


def print_table(title: str, table: dict, modes: list[str]) -> None:
    """One line per tile (BLOCK_N, BLOCK_K, warps, stages, tma, tiles, quant_out), a column
    per mode; * marks each mode's fastest, `gemm_config`'s choice last."""
    best = {m: min((us[m] for us in table.values() if m in us), default=None) for m in modes}
    print(f"{title}, us per call:")
    print(f"{'BLOCK_N BLOCK_K warps stages tma tiles qout':>51s}"
          + "".join(f"{m:>12s} " for m in modes))
    for tile, us in sorted(table.items(), key=lambda kv: kv[0] == "default"):
        label = "default" if tile == "default" else " ".join(
            f"{v:>{w}d}" for v, w in zip(tile, (7, 7, 5, 6, 3, 5, 4)))
        print(f"{label:>51s}" + "".join(
            f"{us[m]:12.1f}{'*' if us[m] == best[m] else ' '}" if m in us else f"{'-':>12s} "
            for m in modes), flush=True)


if __name__ == "__main__":
    main()
