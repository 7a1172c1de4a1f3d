"""One GPU: the expert-output combine (each row's weighted sum of its K slots' rows) as a
row gather + sum over [M, K, H], one `embedding_bag`, and cpmoe's Triton kernel
(`ops.weighted_row_sum`), dense (EP 1) and sparse (EP 2).

    python3 -m bench.moe_combine --tokens 4096,32768,65536
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cpmoe import ops
from cpmoe.bench.timing import cuda_ms


def gather_sum(y, rank_MK, w_MK, n):
    M, K = rank_MK.shape
    per_slot = y[rank_MK.flatten().clamp(max=n - 1)] * w_MK.flatten()[:, None]
    return per_slot.view(M, K, -1).sum(dim=1)


def bag(y, rank_MK, w_MK, n):
    return F.embedding_bag(rank_MK.clamp(max=n - 1), y, mode="sum", per_sample_weights=w_MK)


def triton_sum(y, rank_MK, w_MK, n):
    return ops.weighted_row_sum(y, rank_MK.clamp(max=n - 1), w_MK)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="4096,32768,65536")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    a = p.parse_args()
    dev, K, H = "cuda", a.topk, a.hidden
    for M in map(int, a.tokens.split(",")):
        for ep in (1, 2):
            n = M * K // ep
            y = torch.randn(n, H, device=dev, dtype=torch.bfloat16)
            rank_MK = torch.randperm(M * K, device=dev).view(M, K)
            w_MK = torch.rand(M, K, device=dev, dtype=torch.bfloat16)
            w_MK = torch.where(rank_MK < n, w_MK, 0)
            ref = gather_sum(y, rank_MK, w_MK, n).float()
            times = {}
            for name, fn in (("gather+sum", gather_sum), ("embedding_bag", bag),
                             ("triton", triton_sum)):
                err = (fn(y, rank_MK, w_MK, n).float() - ref).abs().max().item()
                times[name] = cuda_ms(lambda: fn(y, rank_MK, w_MK, n), iters=20)
                times[name + " max|diff|"] = err
            print(f"M={M:6d} K={K} ep={ep}: " + "  ".join(
                f"{k} {v:.3f}" + ("" if "diff" in k else " ms") for k, v in times.items()),
                flush=True)


if __name__ == "__main__":
    main()
