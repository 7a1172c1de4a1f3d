"""How fast a plain streaming read of a decode expert GEMM's bytes runs on the GPU.

    python3 -m bench.read_floor

The W8A8 gate/up GEMM of a decode step at batch 64 (Qwen3-30B-A3B, uniform routing) reads
126 experts x 1536 x 2048 FP8 weights, 396 MB. This times `torch.sum` over as many bytes of
float32 (a memory-bound reduction: one read of every byte, nothing written), rotated over 6
copies so no call finds its input in the 50 MB L2, per call from a CUDA graph of 48 calls
(`bench.decode_kernels.time_us`, which times the GEMM). The same size read by the GEMM and by the
reduction tells whether the GEMM is short of what one kernel's read of those bytes gets,
or at it.

    python3 -m bench.read_floor --bytes 50e6,100e6,200e6,400e6,800e6,1600e6

times several sizes and fits time = fixed + bytes / bandwidth over them (least squares):
the fixed part is what a kernel of this kind pays whatever it reads, the bandwidth what each
further byte costs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.decode_kernels import time_us

EXPERT_BYTES = 126 * 1536 * 2048  # gate/up FP8 weights of the experts 64 rows x top-8 use


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", default=str(EXPERT_BYTES),
                    help="bytes read per call; several, comma-separated, fit fixed + slope")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.read_floor needs a CUDA GPU")
    try:
        sizes = [int(float(b)) for b in args.bytes.split(",")]
    except ValueError:
        sys.exit(f"--bytes: expected byte counts, comma-separated, got {args.bytes!r}")
    if min(sizes) < 4:
        sys.exit(f"--bytes: expected at least 4 bytes each, got {args.bytes}")
    times = []
    for n in sizes:
        xs = [torch.randn(n // 4, device="cuda") for _ in range(6)]
        us = time_us(lambda i: xs[i % len(xs)].sum())
        del xs
        times.append(us)
        print(f"torch.sum over {n / 1e6:.0f} MB: {us:.1f} us, {n / us / 1e6:.2f} TB/s "
              f"({n / us / 1e6 / 4.8:.0%} of 4.8)", flush=True)
    if len(sizes) > 1:
        n = torch.tensor(sizes, dtype=torch.float64)
        t = torch.tensor(times, dtype=torch.float64)
        slope = ((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum()
        fixed = t.mean() - slope * n.mean()
        print(f"fit: time = {fixed:.1f} us + bytes / {1e-6 / slope:.2f} TB/s")


if __name__ == "__main__":
    main()
