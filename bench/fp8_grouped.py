"""Tile sweep of the prefill experts' block-scaled FP8 grouped GEMM (cpmoe/quant/kernels.py)
against bf16 `grouped_mm` on the same shapes, on the GPU.

    python3 -m bench.fp8_grouped --out bench/results/fp8-grouped.json

At Qwen3-30B-A3B's expert shape (128 experts, hidden 2048, intermediate 768, top-8), for
prefill chunks of 4K and 16K tokens with uniform routing (each expert ~1/128 of the slots):
the gate/up GEMM ([P, 2048] x [1536, 2048]^T per expert) and the down GEMM ([P, 768] x
[2048, 768]^T), FP8 under every tile configuration of the sweep vs `grouped_fp8_config`'s
choice vs bf16 `torch.nn.functional.grouped_mm`. A config's "TMA" picks the tile loads
(`fp8_gemm.TMA_MODES`), its "GATHER" (gate/up only) has the kernel read each slot's token
row itself (`a_rows`) where the others read a gathered copy, whose gather is timed once
(`the rows' gather`). Time per call: `timing.cuda_ms` (CUDA
events over 5 back-to-back calls after one untimed; the figures of BENCHMARKS.md at 721b0ce
took the median of 10 calls synced one by one); TFLOP/s = 2 P N K / time. Prints a table
per GEMM; writes JSON. --swiglu: gate/up as the experts run it since 568040c, with its
SwiGLU in the kernel and each slot's token row read through `a_rows` (configs then need
address loads, TMA ''; the default is `grouped_fp8_config(..., a_rows=True, swiglu=True)`);
--gemms picks which of the two GEMMs are timed (the experts' two GEMMs share a tile map, so
a pick for both needs one BM). --rowwise: also `torch._scaled_grouped_mm` (CUTLASS) on the
same sorted rows with one scale a row and one a weight column (the row-wise recipe; it has
no block-scaled grouped form), its output checked against the row-wise dequantized float32
product of the first 4 experts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from cpmoe.bench.provenance import provenance
from cpmoe.bench.timing import cuda_ms
from cpmoe.moe.experts import _grouped_mm
from cpmoe.ops import fp8_gemm
from cpmoe.ops.fp8 import quantize_act, quantize_act_ref

E, H, I, TOP_K = 128, 2048, 768, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--configs", help="a JSON list of configs (grouped_fp8_config's keys) "
                    "to time instead of the tile grid")
    ap.add_argument("--swiglu", action="store_true",
                    help="gate/up with its SwiGLU in the kernel, rows through a_rows")
    ap.add_argument("--gemms", default="gate_up,down", help="which GEMMs to time")
    ap.add_argument("--rowwise", action="store_true",
                    help="also torch._scaled_grouped_mm with row-wise scales")
    args = ap.parse_args()
    torch.manual_seed(0)
    launches = ((4, 3), (4, 4), (4, 5), (8, 3), (8, 4))
    grid = [dict(BM=bm, BN=bn, num_warps=w, num_stages=s) for bm, bn, (w, s) in
            itertools.product((64, 128), (64, 128, 256), launches)]
    if args.configs:
        grid = json.loads(args.configs)
    results = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        P = tokens * TOP_K
        ids = torch.randint(0, E, (P,), device="cuda")
        counts = torch.bincount(ids, minlength=E)
        offs = counts.cumsum(0).to(torch.int32)
        src = torch.sort(ids, stable=True)[1] // TOP_K  # each sorted slot's token
        for name, N, K in (("gate_up", 2 * I, H), ("down", H, I)):
            if name not in args.gemms.split(","):
                continue
            swiglu = args.swiglu and name == "gate_up"
            a = torch.randn(P, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            wq = w.to(torch.float8_e4m3fn)
            ws = torch.rand(E, N // 128, K // 128, device="cuda") + 0.5
            # gate/up's rows are tokens gathered per slot (moe/fp8_experts.py): the configs
            # with "GATHER" read them from the tokens' rows (a_rows), the others from the
            # gathered copy, whose gather this times once
            gather = name == "gate_up"
            if gather:
                tok_q, tok_s = quantize_act(a[:tokens], 128)
                aq, a_s = tok_q[src], tok_s[src]
                g_ms = cuda_ms(lambda: (tok_q[src], tok_s[src]))
                print(f"{name:8s} {tokens:6d} tokens: the rows' gather {g_ms:6.3f} ms",
                      flush=True)
            else:
                aq, a_s = quantize_act(a, 128)
            flops = 2 * P * N * K  # with --swiglu too: gate and up, N = 2 I rows
            bf16 = cuda_ms(lambda: _grouped_mm(a, w.transpose(-2, -1), offs=offs))
            default = fp8_gemm.grouped_fp8_config(P, E, a_rows=swiglu, swiglu=swiglu,
                                                  after_swiglu=args.swiglu and not swiglu)
            if swiglu:  # as fp8_experts caps it: a tile inside one weight scale block
                default["BN"] = min(default["BN"], 128)

            def fp8(cfg):
                cfg = dict(cfg)
                if swiglu:
                    cfg.pop("GATHER", None)
                    return lambda: fp8_gemm.grouped_fp8_gemm(
                        tok_q, tok_s, wq, ws, offs, (128, 128), config=cfg, a_rows=src,
                        swiglu=True)
                if cfg.pop("GATHER", False) and gather:
                    return lambda: fp8_gemm.grouped_fp8_gemm(
                        tok_q, tok_s, wq, ws, offs, (128, 128), config=cfg, a_rows=src)
                return lambda: fp8_gemm.grouped_fp8_gemm(aq, a_s, wq, ws, offs, (128, 128),
                                                        config=cfg)
            base = cuda_ms(fp8(default))
            best = (base, default)
            want = fp8(default)()
            for cfg in grid:
                try:
                    t = cuda_ms(fp8(cfg))
                except Exception as e:  # noqa: BLE001 - a tile that does not fit: skip it
                    print(f"{name} P {P} {cfg}: {type(e).__name__}")
                    continue
                # every config sums each tile's K blocks in the same order: equal outputs
                got = fp8(cfg)()
                equal = torch.equal(got, want)
                if not equal:
                    print(f"{name} P {P} {cfg}: output differs from the default's by up to "
                          f"{float((got.float() - want.float()).abs().max()):.3g}")
                results.append({"gemm": name, "tokens": tokens, "ms": t, "equal": equal,
                                "tflops": flops / t / 1e9, **cfg})
                if args.configs:
                    print(f"{name:8s} {tokens:6d} tokens: {t:6.3f} ms "
                          f"({flops / t / 1e9:5.0f} TFLOP/s) {cfg}", flush=True)
                if t < best[0]:
                    best = (t, cfg)
            results.append({"gemm": name, "tokens": tokens, "ms": base, "default": True,
                            "bf16_ms": bf16, "tflops": flops / base / 1e9, **default})
            if args.rowwise:
                results.append(rowwise(name, tokens, a, w, offs, flops, bf16))
            print(f"{name:8s} {tokens:6d} tokens: bf16 grouped_mm {bf16:6.3f} ms "
                  f"({flops / bf16 / 1e9:5.0f} TFLOP/s) | FP8 default {base:6.3f} ms "
                  f"({flops / base / 1e9:5.0f}) {default} | best {best[0]:6.3f} ms "
                  f"({flops / best[0] / 1e9:5.0f}) {best[1]} | best FP8 / bf16 "
                  f"{bf16 / best[0]:.2f}x", flush=True)
    with open(args.out, "w") as f:
        json.dump({"header": provenance(sys.argv), "results": results}, f, indent=1)


def rowwise(name: str, tokens: int, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
            flops: int, bf16: float) -> dict:
    """`torch._scaled_grouped_mm` on a [P, K] x w [E, N, K]^T: a quantized per row, w per
    (expert, column), each at amax / 448 (`quantize_act_ref` with one group a row) -> its
    result row."""
    E, N, K = w.shape
    aq, a_s = quantize_act_ref(a, K)
    wq, w_s = quantize_act_ref(w.reshape(E * N, K), K)
    a_s, wq, w_s = a_s[:, 0], wq.view(E, N, K), w_s.view(E, N)
    row = {"gemm": name, "tokens": tokens, "path": "_scaled_grouped_mm rowwise"}
    try:
        def run():
            return torch._scaled_grouped_mm(aq, wq.transpose(-2, -1), a_s, w_s, offs=offs,
                                            out_dtype=torch.bfloat16)
        got = run()
        ms = cuda_ms(run)
    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
        error = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"{name:8s} {tokens:6d} tokens: _scaled_grouped_mm rowwise: {error}", flush=True)
        return dict(row, error=error)
    end = int(offs[3])
    starts = [0] + offs[:3].tolist()
    want = torch.cat([(aq[s:e].float() * a_s[s:e, None]) @ (wq[i].float() * w_s[i, :, None]).t()
                      for i, (s, e) in enumerate(zip(starts, offs[:4].tolist()))])
    err = float((got[:end].float() - want).abs().max() / want.abs().max())
    print(f"{name:8s} {tokens:6d} tokens: _scaled_grouped_mm rowwise {ms:6.3f} ms "
          f"({flops / ms / 1e9:5.0f} TFLOP/s), bf16 / it {bf16 / ms:.2f}x, max error "
          f"{err:.2e} of the largest output (4 experts)", flush=True)
    return dict(row, ms=ms, tflops=flops / ms / 1e9, max_rel_err=err)


if __name__ == "__main__":
    main()
