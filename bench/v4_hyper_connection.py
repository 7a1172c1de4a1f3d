"""DeepSeek-V4's hyper-connection stream arithmetic on the GPU: the Triton kernels
(cpmoe/models/deepseek_v4/hyper_connection.py) against the torch expressions they replaced, with the HBM
floor of each.

    python3 -m bench.v4_hyper_connection
    python3 -m bench.v4_hyper_connection --lengths 4096,16384 --sweep --out bench/results/x.json

At V4's default widths (hc 4 streams of H 4096, bf16; float32 post, pre, comb and mix
weights, comb doubly stochastic-ish), T rows of each length:
- merge: h' = post * out + comb^T h (`hc_merge` vs the torch branch of
  `DeepseekV4HyperConnection.merge`: a bf16 batched matmul and two elementwise ops);
- collapse: x = sum_i pre_i h_i (`hc_collapse` vs `(pre[..., None] * h).sum(1)`);
- mix: the float32 F.linear of the RMS-normed streams (`hc_mix`, which reads h once for the
  linear and the norm, vs `F.linear(_flat_rms(h), fn)`), (2 + hc) hc outputs a row.
Prints per length and op the milliseconds of both (CUDA events, mean of --iters after one
untimed call), their ratio, the kernel's HBM traffic rate and the floor: the bytes it must
move (merge: read h and out, write h'; collapse: read h, write x; mix: read h) at --hbm-tbs
(4.8 TB/s, the H200's HBM3e peak), and the largest difference of the two results. --sweep
also times merge, collapse and mix over tile and launch options, for tuning the defaults.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cpmoe.models.deepseek_v4 import hyper_connection as hc
# the model's own torch branches, what the kernels replace on CUDA in 16 bits
from cpmoe.models.deepseek_v4.model import _collapse_torch as torch_collapse
from cpmoe.models.deepseek_v4.model import _flat_rms
from cpmoe.models.deepseek_v4.model import _merge_torch as torch_merge

SWEEP = {"block_t": (1, 2, 4, 8), "block_h": (256, 512, 1024), "num_warps": (4, 8)}
MIX_SWEEP = {"block_t": (16, 32, 64), "block_k": (32, 64, 128), "num_warps": (4, 8)}
EPS = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384", help="rows T")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--hc", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM peak, TB/s (the floor)")
    p.add_argument("--sweep", action="store_true", help="also sweep the kernels' options")
    p.add_argument("--out", help="write the results here as JSON")
    return p.parse_args(argv)


def floor_bytes(T: int, hc_mult: int, H: int, elem: int) -> dict[str, int]:
    """Bytes each op must move through HBM (the float32 weights, T * hc^2 * 4 at most, are
    left out: under 1% of h)."""
    h = T * hc_mult * H * elem
    return {"merge": 2 * h + T * H * elem, "collapse": h + T * H * elem, "mix": h}


def bench_length(a: argparse.Namespace, T: int, dev: torch.device,
                 gen: torch.Generator) -> dict:
    """The three ops at T rows -> a result row (printed as it goes)."""
    from cpmoe.bench.timing import cuda_ms, sweep_ms

    c, H = a.hc, a.hidden
    h = torch.randn(T, c, H, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
    post = 2 * torch.rand(T, c, device=dev, generator=gen)
    pre = torch.rand(T, c, device=dev, generator=gen) + 1e-6
    comb = torch.softmax(torch.randn(T, c, c, device=dev, generator=gen), -1)
    fn = torch.randn((2 + c) * c, c * H, device=dev, generator=gen) * (c * H) ** -0.5
    pairs = {
        "merge": (lambda: hc.hc_merge(h, out, post, comb),
                  lambda: torch_merge(h, out, post, comb)),
        "collapse": (lambda: hc.hc_collapse(h, pre), lambda: torch_collapse(h, pre)),
        "mix": (lambda: hc.hc_mix(h, fn, EPS), lambda: F.linear(_flat_rms(h, EPS), fn)),
    }
    nbytes = floor_bytes(T, c, H, h.element_size())
    row: dict = {"rows": T}
    for op, (kernel, reference) in pairs.items():
        ms_k, ms_r = cuda_ms(kernel, a.iters), cuda_ms(reference, a.iters)
        floor = nbytes[op] / (a.hbm_tbs * 1e9)
        diff = (kernel().float() - reference().float()).abs().max().item()
        row[op] = {"kernel_ms": ms_k, "torch_ms": ms_r, "speedup": ms_r / ms_k,
                   "floor_ms": floor, "kernel_tbs": nbytes[op] / ms_k / 1e9,
                   "max_abs_diff": diff}
        print(f"T={T} {op}: kernel {ms_k:.3f} ms ({nbytes[op] / ms_k / 1e9:.2f} TB/s), "
              f"torch {ms_r:.3f} ms, {ms_r / ms_k:.1f}x; HBM floor {floor:.3f} ms; "
              f"max |diff| {diff:.3g}", flush=True)
    if a.sweep:
        makers = {"merge": (lambda **o: lambda: hc.hc_merge(h, out, post, comb, **o), SWEEP),
                  "collapse": (lambda **o: lambda: hc.hc_collapse(h, pre, **o), SWEEP),
                  "mix": (lambda **o: lambda: hc.hc_mix(h, fn, EPS, **o), MIX_SWEEP)}
        for op, (make, grid) in makers.items():
            print(f"T={T} {op} sweep (fastest 8):", flush=True)
            row[op]["sweep"] = sweep_ms(make, grid, nbytes[op], a.iters, "tbs", show=8)
    return row


def main(argv: list[str] | None = None) -> None:
    from cpmoe.bench.timing import run_lengths
    run_lengths("v4_hyper_connection", parse_args(argv), hc.triton is not None, bench_length)


if __name__ == "__main__":
    main()
