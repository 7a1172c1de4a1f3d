"""DeepSeek-V4 prefill's sparse sink attention on the GPU: the Triton kernel that walks each
row's index list (cpmoe/models/deepseek_v4/sparse.py) against the gather + fp32
`sink_attention` path it replaced, both over the row blocks the prefill plan makes for them.

    python3 -m bench.v4_sparse_attention
    python3 -m bench.v4_sparse_attention --lengths 4096,16384 --sweep --out bench/results/x.json

At V4's default widths (64 query heads, head dim 512, window 128, CSA top-512 at rate 4,
64 indexer heads), one prompt of each length on one rank: T = L query rows at positions
0..L-1, a pool of L KV rows then L/4 compressed entries (bf16, unit RMS like the normed
rows), and per row the keys a CSA layer gives it: its window (positions p-127..p, those >= 0
valid) then min(512, visible entries) picks among the entries it may read ((p+1)//4), the
rest invalid, as `select_visible` pads them. Blocks: `rows_per_block` of each path (the
kernel's are larger: nothing gathered). Prints per length the milliseconds of both (CUDA
events, mean of --iters after one untimed call), their ratio, the kernel's TFLOP/s
(4 * Hq * D * valid keys, the two matmuls) and the largest difference of the two outputs.
--sweep also times the kernel over tile and launch options (heads a program, keys a tile,
warps, stages) at each length, for tuning the defaults; an option set that does not
compile or fit is reported and skipped.
"""

from __future__ import annotations

import argparse

import torch

from cpmoe.models.deepseek_v4 import sparse
from cpmoe.models.deepseek_v4.prefill import rows_per_block, sink_attention

SWEEP = {"block_h": (16, 32, 64), "block_n": (16, 32, 64), "num_warps": (4, 8),
         "num_stages": (1, 2, 3)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384", help="prompt lengths (query rows)")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--rate", type=int, default=4, help="CSA compress rate")
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also sweep the kernel's options")
    p.add_argument("--out", help="write the results here as JSON")
    return p.parse_args(argv)


def csa_rows(L: int, window: int, topk: int, rate: int, device: torch.device,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [L, W + K] int64 into [L KV rows ; L // rate entries], valid [L, W + K] bool) of
    one prompt's rows at positions 0..L-1 in a CSA layer; picks random among visible."""
    pos = torch.arange(L, device=device)
    kpos = pos[:, None] - (window - 1) + torch.arange(window, device=device)
    E = L // rate
    k = min(topk, E)
    picks = torch.zeros(L, k, dtype=torch.int64, device=device)
    seen_picks = torch.zeros(L, k, dtype=torch.bool, device=device)
    for r0 in range(0, L if k else 0, 1024):  # random scores [rows, E] a block at a time
        r = slice(r0, r0 + 1024)
        seen = torch.arange(E, device=device)[None, :] < ((pos[r] + 1) // rate)[:, None]
        scores = torch.rand(seen.shape, device=device, generator=gen)
        picks[r] = scores.masked_fill(~seen, -1.0).topk(k, dim=1).indices
        seen_picks[r] = seen.gather(1, picks[r])
    idx = torch.cat([kpos.clamp(min=0), L + picks], dim=1)
    return idx, torch.cat([kpos >= 0, seen_picks], dim=1)


def run_blocks(fn, T: int, rows: int) -> None:
    for r0 in range(0, T, rows):
        fn(slice(r0, min(T, r0 + rows)))


def bench_length(a: argparse.Namespace, L: int, dev: torch.device,
                 gen: torch.Generator) -> dict:
    """Both paths at one prompt length -> a result row (printed as it goes)."""
    from cpmoe.bench.timing import cuda_ms, sweep_ms

    H, D = a.heads, a.dim
    idx, valid = csa_rows(L, a.window, a.topk, a.rate, dev, gen)
    pool = torch.randn(L + L // a.rate, D, device=dev, generator=gen).to(torch.bfloat16)
    q = torch.randn(L, H, D, device=dev, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(H, device=dev, generator=gen)
    scale, keys = D ** -0.5, idx.shape[1]
    entries = L // a.rate
    rows_k = rows_per_block(keys, H, D, a.index_heads, entries, kernel=True)
    rows_r = rows_per_block(keys, H, D, a.index_heads, entries, kernel=False)
    out_k, out_r = torch.empty_like(q), torch.empty_like(q)

    def kernel(**opts):
        return lambda: run_blocks(lambda r: sparse.sparse_sink_attention(
            q[r], pool, idx[r], valid[r], sinks, scale, out_k[r], **opts), L, rows_k)

    def reference():
        def block(r):
            out_r[r] = sink_attention(q[r], pool[idx[r]], valid[r], sinks, scale)
        run_blocks(block, L, rows_r)

    ms_k, ms_r = cuda_ms(kernel(), a.iters), cuda_ms(reference, a.iters)
    flops = 4 * H * D * int(valid.sum())
    diff = (out_k.float() - out_r.float()).abs().max().item()
    row = {"length": L, "keys_per_row": keys, "valid_keys": int(valid.sum()),
           "kernel_block_rows": rows_k, "reference_block_rows": rows_r,
           "kernel_ms": ms_k, "reference_ms": ms_r, "speedup": ms_r / ms_k,
           "kernel_tflops": flops / ms_k / 1e9, "max_abs_diff": diff}
    print(f"L={L}: kernel {ms_k:.2f} ms ({rows_k}-row blocks, {row['kernel_tflops']:.0f} "
          f"TFLOP/s), gather + sink_attention {ms_r:.2f} ms ({rows_r}-row blocks), "
          f"{ms_r / ms_k:.2f}x; max |diff| {diff:.3g}", flush=True)
    if a.sweep:
        row["sweep"] = sweep_ms(kernel, SWEEP, flops, a.iters)
    return row


def main(argv: list[str] | None = None) -> None:
    from cpmoe.bench.timing import run_lengths
    run_lengths("v4_sparse_attention", parse_args(argv), sparse.triton is not None, bench_length)


if __name__ == "__main__":
    main()
