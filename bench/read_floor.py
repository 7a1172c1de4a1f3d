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

    python3 -m bench.read_floor --bytes ... --kernel stream --programs 132,264,528,1056

reads with a Triton kernel of our own instead: `programs` programs stride over the bytes,
32 KB a step each (16 bytes a thread a load, 8 loads in flight a thread on 8 warps), so the
fixed part of a kernel that keeps every SM streaming to its last byte can be told from
torch.sum's.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.decode_kernels import time_us
from cpmoe._triton import import_triton

triton, tl = import_triton()

EXPERT_BYTES = 126 * 1536 * 2048  # gate/up FP8 weights of the experts 64 rows x top-8 use


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", default=str(EXPERT_BYTES),
                    help="bytes read per call; several, comma-separated, fit fixed + slope")
    ap.add_argument("--kernel", choices=("sum", "stream"), default="sum",
                    help="torch.sum, or our grid-stride Triton read (see the docstring)")
    ap.add_argument("--programs", default="528",
                    help="--kernel stream: programs of the grid, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.read_floor needs a CUDA GPU")
    try:
        sizes = [int(float(b)) for b in args.bytes.split(",")]
        grids = [int(p) for p in args.programs.split(",")]
    except ValueError:
        sys.exit(f"--bytes / --programs: expected numbers, comma-separated, got "
                 f"{args.bytes!r} / {args.programs!r}")
    if min(sizes) < 4 or min(grids) < 1:
        sys.exit(f"--bytes: expected at least 4 bytes each, --programs at least 1; got "
                 f"{args.bytes} / {args.programs}")
    for programs in grids if args.kernel == "stream" else [0]:
        times = []
        for n in sizes:
            xs = [torch.randn(n // 4, device="cuda") for _ in range(6)]
            out = torch.empty(max(1, programs), device="cuda")
            if args.kernel == "sum":
                name = "torch.sum"
                us = time_us(lambda i: xs[i % len(xs)].sum())
            else:
                name = f"stream x {programs}"
                us = time_us(lambda i: _stream_read_kernel[(programs,)](
                    xs[i % len(xs)], out, n // 4, BLOCK=_STREAM_BLOCK, num_warps=8))
            del xs
            times.append(us)
            print(f"{name} over {n / 1e6:.0f} MB: {us:.1f} us, {n / us / 1e6:.2f} TB/s "
                  f"({n / us / 1e6 / 4.8:.0%} of 4.8)", flush=True)
        if len(sizes) > 1:
            n = torch.tensor(sizes, dtype=torch.float64)
            t = torch.tensor(times, dtype=torch.float64)
            slope = ((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum()
            fixed = t.mean() - slope * n.mean()
            print(f"{name} fit: time = {fixed:.1f} us + bytes / {1e-6 / slope:.2f} TB/s")


_STREAM_BLOCK = 8192  # float32 a step: 32 KB, 8 x 16 bytes a thread on 8 warps

if triton is not None:
    @triton.jit
    def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """Program p sums x[p * BLOCK + k * programs * BLOCK + ...] over k: one read of
        every element, one float32 written a program."""
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


if __name__ == "__main__":
    main()
