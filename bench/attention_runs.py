"""One GPU, no communication: each CP rank's share of prefill attention at one length, with
the kernel variants side by side, to find per-rank imbalance and the fastest GQA path.

    python3 -m bench.attention_runs --lengths 65536,131072 --cp 2

Rows: `runs` = cpmoe's prefill_attention on that rank's query runs (K/V as after the
all-gather); `ideal` = 1-GPU causal SDPA time / cp. Variants of the per-run kernel call:
cuDNN on repeated K/V heads, cuDNN on the raw GQA heads, flash on repeated heads.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cpmoe.bench.timing import cuda_ms
from cpmoe.cp import attention as A
from cpmoe.cp.split import CPSplit


CURRENT = A.attention_with_lse


def _kernel(gqa: bool, cudnn: bool):
    def attention_with_lse(q, k, v, causal, scale):
        if not gqa and k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if cudnn:
            o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        else:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale)[:2]
        return o, lse.reshape(q.shape[:3]).float()
    return attention_with_lse


VARIANTS = {"current": CURRENT, "repeat-cudnn": _kernel(False, True),
            "gqa-cudnn": _kernel(True, True),
            "repeat-flash": _kernel(False, False)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    a = p.parse_args()
    dev, dt, D = torch.device("cuda"), torch.bfloat16, 128
    H, Hkv, scale = a.heads, a.kv_heads, 128 ** -0.5
    for L in map(int, a.lengths.split(",")):
        kv = torch.randn(L, 2, Hkv, D, device=dev, dtype=dt)  # the gathered layout
        k, v = kv[:, 0], kv[:, 1]
        qf = torch.randn(L, H, D, device=dev, dtype=dt)
        one = cuda_ms(lambda: F.scaled_dot_product_attention(
            qf.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True))
        print(f"== L={L} cp={a.cp}: 1-GPU causal SDPA (GQA) {one:.2f} ms, ideal/rank "
              f"{one / a.cp:.2f} ms", flush=True)
        split = CPSplit.build([L], a.cp, "zigzag")
        for r in range(a.cp):
            pos, seq = split.local_positions(r).to(dev), split.local_token_to_seq(r).to(dev)
            runs = A.query_runs(pos, seq)
            q = qf[pos]
            ref = None
            for name, kernel in VARIANTS.items():
                A.attention_with_lse = kernel
                try:
                    t = cuda_ms(lambda: A._prefill_runs_cuda(q, k, v, [0, L], scale, runs))
                    o = A._prefill_runs_cuda(q, k, v, [0, L], scale, runs)
                except RuntimeError as e:
                    print(f"  rank {r} {name:<13} failed: {str(e).splitlines()[0][:120]}")
                    continue
                ref = o if ref is None else ref
                diff = (o.float() - ref.float()).abs().max().item()
                print(f"  rank {r} {name:<13} {t:8.2f} ms  runs={len(runs)}  "
                      f"max|diff| vs first {diff:.3g}", flush=True)
            A.attention_with_lse = CURRENT


if __name__ == "__main__":
    main()
