"""The decode experts end to end, one kernel a layer against two GEMMs, on the GPU.

    python3 -m bench.decode_layer --out bench/results/decode-layer.json

At Qwen3-30B-A3B's expert shape (128 experts, hidden 2048, intermediate 768, top-8) and
uniform routing, for 1, 16 and 64 rows, in bf16 and in FP8 (128 x 128 block scales, each
of `fused_moe.FP8_ACT_MODES`' W8A8 modes): `fused_moe.fused_experts` as a decode step runs
it (the slot alignment, the expert kernels, the routing-weighted sum), with "gemms" (the
gate/up and down GEMMs, `_expert_gemm_kernel`) and with "layer" (`_expert_layer_kernel`)
under `layer_config`'s choice and the variants of --variants (SPLIT, warps, stages, BLOCK_N).
Weights of several layers are rotated so no repetition finds a previous one's experts in
L2; time in microseconds per call, CUDA events over a graph replay (bench.decode_kernels).
Each line also gives the HBM floor: the used experts' weight bytes at 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.decode_kernels import E, H, I, LAYERS, TOP_K, routed, time_us
from cpmoe.bench.provenance import provenance
from cpmoe.moe import fused_moe


def parse_variants(text: str) -> list[dict]:
    """'SPLIT=1;SPLIT=3,num_stages=4' -> [{'SPLIT': 1}, {'SPLIT': 3, 'num_stages': 4}]."""
    out = []
    for item in filter(None, text.split(";")):
        try:
            out.append({k: int(v) for k, v in (kv.split("=") for kv in item.split(","))})
        except ValueError:
            sys.exit(f"--variants: expected KEY=INT[,KEY=INT][;...], got {item!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--variants", default="SPLIT=1;SPLIT=3;SPLIT=6;num_stages=4;num_warps=8;"
                    "BLOCK_N=64;BLOCK_N=256", help="layer_config overrides tried at 64 rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    variants = parse_variants(args.variants)
    layer_config = fused_moe.layer_config
    results = []
    for dtype in ("bf16", "fp8"):
        wdtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
        gate_up = [(torch.randn(E, 2 * I, H, device="cuda") * 0.02).to(wdtype)
                   for _ in range(LAYERS)]
        down = [(torch.randn(E, H, I, device="cuda") * 0.02).to(wdtype) for _ in range(LAYERS)]
        scales = [(torch.rand(E, 2 * I // 128, H // 128, device="cuda") + 0.5,
                   torch.rand(E, H // 128, I // 128, device="cuda") + 0.5)
                  if dtype == "fp8" else None for _ in range(LAYERS)]
        modes = ("w8a8", "w8a8-fused") if dtype == "fp8" else (None,)
        for rows in [int(r) for r in args.rows.split(",")]:
            ids = routed(rows, gen)
            x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
            w = torch.rand(rows, TOP_K, device="cuda")
            used = len(torch.unique(ids))
            floor = used * 3 * I * H * wdtype.itemsize / 4.8e12 * 1e6
            for mode in modes:
                tries = [("gemms", None), ("layer", None)]
                tries += [("layer", v) for v in variants] if rows == 64 else []
                for kernel, over in tries:
                    def forced(*a, kernel=kernel, over=over, **kw):
                        cfg = layer_config(*a, **dict(kw, kernel=kernel))
                        return cfg if cfg is None or over is None else dict(cfg, **over)
                    fused_moe.layer_config = forced
                    cfg = forced(rows * TOP_K, E, H, I, dtype == "fp8", mode,
                                 sms=fused_moe._sm_count(x.device))

                    def run(i):
                        fused_moe.fused_experts(x, ids, w, gate_up[i % LAYERS],
                                                down[i % LAYERS], scales[i % LAYERS],
                                                fp8_act=mode)
                    try:
                        us = time_us(run)
                    except Exception as e:  # noqa: BLE001 - a variant that does not fit
                        print(f"{dtype} {mode} rows {rows} {kernel} {over}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                        continue
                    finally:
                        fused_moe.layer_config = layer_config
                    label = kernel if over is None else f"{kernel} {over}"
                    print(f"{dtype:4s} {mode or '':10s} rows {rows:3d} {label:40s} {us:8.1f} us"
                          f"  (floor {floor:.1f} us, x{us / floor:.2f})", flush=True)
                    results.append({"dtype": dtype, "mode": mode, "rows": rows,
                                    "kernel": kernel, "override": over, "config": cfg,
                                    "us": us, "hbm_floor_us": floor})
        del gate_up, down, scales
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"header": provenance(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
