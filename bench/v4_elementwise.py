"""DeepSeek-V4's fused elementwise kernels on the GPU against the torch expressions they
replaced, with the HBM floor of each.

    python3 -m bench.v4_elementwise
    python3 -m bench.v4_elementwise --lengths 16384 --out bench/results/x.json

At V4's default widths (64 heads of 512 with 64 rotated channels, hidden 4096, expert
intermediate 2048, top-6), bf16, T rows of each length:
- q_norm_rope: `head_norm_rope_` on q [T, 64, 512] vs unweighted_rms_norm then
  apply_interleaved_rope (floor: read and write q);
- inverse_rope: `head_norm_rope_` with the norm off and -sin vs apply_interleaved_rope(out,
  cos, -sin) (floor: read and write the 64 rotated channels);
- rms_norm: `ops.rms_norm_fp32_weight` on [T, 4096] vs `layers.rms_norm_ref` (RMSNorm's
  torch expression) with a float32 weight (floor: read x, write the result);
- swiglu: `ops.clamped_swiglu` on the halves of packed [6T, 2 x 2048] rows vs its torch
  expression (floor: read both halves, write the result).
Prints per length and op the milliseconds of both (CUDA events, mean of --iters after one
untimed call), their ratio and the floor at --hbm-tbs.
"""

from __future__ import annotations

import argparse

import torch

from cpmoe import ops
from cpmoe.models.deepseek_v4.rope import head_norm_rope_
from cpmoe.models.layers import apply_interleaved_rope, rms_norm_ref, unweighted_rms_norm

EPS = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384", help="rows T")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM peak, TB/s (the floor)")
    p.add_argument("--out", help="write the results here as JSON")
    return p.parse_args(argv)


def bench_length(a: argparse.Namespace, T: int, dev: torch.device,
                 gen: torch.Generator) -> dict:
    """The four ops at T rows -> a result row (printed as it goes)."""
    from cpmoe.bench.timing import cuda_ms

    bf = torch.bfloat16
    q = torch.randn(T, 64, 512, device=dev, generator=gen).to(bf)
    freqs = torch.rand(T, 32, device=dev, generator=gen) * 100
    cos, sin = freqs.cos().to(bf), freqs.sin().to(bf)
    x = torch.randn(T, 4096, device=dev, generator=gen).to(bf)
    w = torch.rand(4096, device=dev, generator=gen) + 0.5
    h = torch.randn(6 * T, 2 * 2048, device=dev, generator=gen).to(bf)
    gate, up = h.chunk(2, dim=-1)
    work = q.clone()
    pairs = {
        "q_norm_rope": (lambda: head_norm_rope_(work.copy_(q), cos, sin, EPS),
                        lambda: apply_interleaved_rope(unweighted_rms_norm(q, EPS), cos, sin),
                        lambda: work.copy_(q), 2 * q.nbytes),
        "inverse_rope": (lambda: head_norm_rope_(work, cos, sin, EPS, norm=False,
                                                 sin_sign=-1.0),
                         lambda: apply_interleaved_rope(q, cos, -sin), None, q.nbytes // 4),
        "rms_norm": (lambda: ops.rms_norm_fp32_weight(x, w, EPS), lambda: rms_norm_ref(x, w, EPS),
                     None, 2 * x.nbytes),
        "swiglu": (lambda: ops.clamped_swiglu(gate, up, 10.0),
                   lambda: ops.clamped_swiglu_ref(gate, up, 10.0), None, 3 * h.nbytes // 4),
    }
    row: dict = {"rows": T}
    for op, (kernel, reference, setup, nbytes) in pairs.items():
        ms_k, ms_r = cuda_ms(kernel, a.iters), cuda_ms(reference, a.iters)
        if setup is not None:  # the in-place kernel's copy of its input, timed apart
            ms_k -= cuda_ms(setup, a.iters)
        floor = nbytes / (a.hbm_tbs * 1e9)
        row[op] = {"kernel_ms": ms_k, "torch_ms": ms_r, "floor_ms": floor}
        print(f"T={T} {op}: kernel {ms_k:.3f} ms, torch {ms_r:.3f} ms, "
              f"{ms_r / ms_k:.1f}x; HBM floor {floor:.3f} ms", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    from cpmoe.bench.timing import run_lengths
    run_lengths("v4_elementwise", parse_args(argv), ops.triton is not None, bench_length)


if __name__ == "__main__":
    main()
