"""How fast a plain streaming read of a decode expert GEMM's bytes runs on the GPU.

    python3 -m bench.read_floor

The W8A8 gate/up GEMM of a decode step at batch 64 (Qwen3-30B-A3B, uniform routing) reads
126 experts x 1536 x 2048 FP8 weights, 396 MB. This times `torch.sum` over as many bytes of
float32 (a memory-bound reduction: one read of every byte, nothing written), rotated over 6
copies so no call finds its input in the 50 MB L2, per call from a CUDA graph of 48 calls
(`bench.decode_kernels.time_us`, which times the GEMM). The same size read by the GEMM and by the
reduction tells whether the GEMM is short of what one kernel's read of those bytes gets,
or at it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.decode_kernels import time_us

EXPERT_BYTES = 126 * 1536 * 2048  # gate/up FP8 weights of the experts 64 rows x top-8 use


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=EXPERT_BYTES, help="bytes read per call")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.read_floor needs a CUDA GPU")
    if args.bytes < 4:
        sys.exit(f"--bytes: expected at least 4, got {args.bytes}")
    n = args.bytes
    xs = [torch.randn(n // 4, device="cuda") for _ in range(6)]
    us = time_us(lambda i: xs[i % len(xs)].sum())
    print(f"torch.sum over {n / 1e6:.0f} MB: {us:.1f} us, {n / us / 1e6:.2f} TB/s "
          f"({n / us / 1e6 / 4.8:.0%} of 4.8)")


if __name__ == "__main__":
    main()
