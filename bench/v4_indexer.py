"""DeepSeek-V4 prefill's lightning-indexer scores on the GPU: the Triton kernel
(cpmoe/models/deepseek_v4/indexer.py) against the fp32 matmul path it replaced (the scorer's
torch branch: [rows, heads, entries] fp32 dot products, relu, weights, sum over heads), both
over the row blocks the prefill plan makes for them.

    python3 -m bench.v4_indexer
    python3 -m bench.v4_indexer --lengths 4096,16384 --sweep --out bench/results/x.json

At V4's default widths (64 index heads of 128; CSA rate 4; for the blocks also 64 query
heads of 512, window 128, top-512), one prompt of each length on one rank: T = L query rows
at positions 0..L-1 against its C = L/4 entries (bf16 q and keys, unit variance; fp32 head
weights of scale heads^-0.5), entry c visible to the row at position p when c < (p+1)//4,
masked to -inf on both paths as `select_visible` needs (the kernel: by row bounds).
Blocks: `rows_per_block` of each path (the kernel's are larger: no [rows, heads, entries]
temporary). Prints per length the
milliseconds of both (CUDA events, mean of --iters after one untimed call), their ratio, the
kernel's TFLOP/s (2 * T * heads * C * dim, every tile computed, masked or not) and the
largest difference of the two paths' visible scores; and the picks of each (the kernel's
top-k over its order keys, the torch path's stable sort). --sweep also times the kernel over tile
and launch options (rows a tile, entries a tile, warps, stages) at each length, for tuning
the defaults; an option set that does not compile or fit is reported and skipped.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cpmoe.models.deepseek_v4 import indexer
from cpmoe.models.deepseek_v4.prefill import rows_per_block

SWEEP = {"block_t": (32, 64, 128), "block_c": (32, 64, 128, 256), "num_warps": (4, 8),
         "num_stages": (1, 2, 3)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384", help="prompt lengths (query rows)")
    p.add_argument("--heads", type=int, default=64, help="index heads")
    p.add_argument("--dim", type=int, default=128, help="index head dim")
    p.add_argument("--rate", type=int, default=4, help="CSA compress rate")
    p.add_argument("--attn-heads", type=int, default=64, help="query heads (block sizes)")
    p.add_argument("--head-dim", type=int, default=512, help="head dim (block sizes)")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also sweep the kernel's options")
    p.add_argument("--out", help="write the results here as JSON")
    return p.parse_args(argv)


def torch_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, scale: float,
                 visible: torch.Tensor) -> torch.Tensor:
    """The scorer's torch branch for 16-bit q [T, h, D] and keys [C, D] (its operations in
    its order; w [T, h] fp32, already scaled) -> [T, C] fp32, -inf where not visible."""
    scores = F.relu(torch.matmul(q.float(), keys.float().T)) * scale
    scores = (scores * w[..., None]).sum(dim=1).float()
    return scores.masked_fill(~visible, float("-inf"))


def causal_visible(L: int, rate: int, device: torch.device) -> torch.Tensor:
    """[L, L // rate] bool: entry c is closed for the row at position p when c < (p+1)//rate."""
    pos = torch.arange(L, device=device)
    return torch.arange(L // rate, device=device)[None, :] < ((pos + 1) // rate)[:, None]


def run_blocks(fn, T: int, rows: int) -> None:
    for r0 in range(0, T, rows):
        fn(slice(r0, min(T, r0 + rows)))


def bench_length(a: argparse.Namespace, L: int, dev: torch.device,
                 gen: torch.Generator) -> dict:
    """Both paths at one prompt length -> a result row (printed as it goes)."""
    from cpmoe.bench.timing import cuda_ms, sweep_ms

    H, D, C = a.heads, a.dim, L // a.rate
    q = torch.randn(L, H, D, device=dev, generator=gen).to(torch.bfloat16)
    keys = torch.randn(C, D, device=dev, generator=gen).to(torch.bfloat16)
    w = torch.randn(L, H, device=dev, generator=gen) * H ** -0.5
    visible, scale = causal_visible(L, a.rate, dev), D ** -0.5
    hi = (torch.arange(L, device=dev) + 1) // a.rate  # the kernel's bounds of the same mask
    lo = torch.zeros_like(hi)
    attn_keys = a.window + min(a.topk, C)
    rows_k = rows_per_block(attn_keys, a.attn_heads, a.head_dim, H, C, kernel=True)
    rows_r = rows_per_block(attn_keys, a.attn_heads, a.head_dim, H, C, kernel=False)

    def kernel(**opts):
        return lambda: run_blocks(lambda r: indexer.indexer_scores(
            q[r], keys, w[r], scale, (lo[r], hi[r]), **opts), L, rows_k)

    def kernel_topk():
        run_blocks(lambda r: indexer.indexer_topk(q[r], keys, w[r], scale, (lo[r], hi[r]),
                                                  a.topk), L, rows_k)

    def reference():
        run_blocks(lambda r: torch_scores(q[r], keys, w[r], scale, visible[r]), L, rows_r)

    def reference_sort():  # the torch path's picks: a stable sort of its scores
        run_blocks(lambda r: torch_scores(q[r], keys, w[r], scale, visible[r]).sort(
            dim=-1, descending=True, stable=True).indices[:, :a.topk], L, rows_r)

    ms_k, ms_r = cuda_ms(kernel(), a.iters), cuda_ms(reference, a.iters)
    ms_kt, ms_rs = cuda_ms(kernel_topk, a.iters), cuda_ms(reference_sort, a.iters)
    flops = 2 * L * H * C * D
    diff, top = largest_difference(q, keys, w, scale, (lo, hi), visible, rows_k, rows_r)
    row = {"length": L, "entries": C, "kernel_block_rows": rows_k,
           "reference_block_rows": rows_r, "kernel_ms": ms_k, "reference_ms": ms_r,
           "speedup": ms_r / ms_k, "kernel_tflops": flops / ms_k / 1e9,
           "kernel_topk_ms": ms_kt, "reference_sort_ms": ms_rs,
           "max_abs_diff": diff, "max_abs_score": top}
    print(f"L={L} (C={C}): kernel {ms_k:.2f} ms ({rows_k}-row blocks, "
          f"{row['kernel_tflops']:.0f} TFLOP/s), fp32 matmul path {ms_r:.2f} ms ({rows_r}-row "
          f"blocks), {ms_r / ms_k:.2f}x; with the top-{a.topk}: kernel + topk {ms_kt:.2f} ms, "
          f"torch path + stable sort {ms_rs:.2f} ms; max |diff| {diff:.3g} (max |score| "
          f"{top:.3g})", flush=True)
    if a.sweep:
        row["sweep"] = sweep_ms(kernel, SWEEP, flops, a.iters)
    return row


def largest_difference(q, keys, w, scale, bounds, visible, rows_k: int, rows_r: int
                       ) -> tuple[float, float]:
    """(max |kernel - torch path|, max |torch path|) over the visible scores."""
    got = torch.empty(visible.shape, device=q.device)
    want = torch.empty_like(got)

    def kernel_block(r):
        got[r] = indexer.indexer_scores(q[r], keys, w[r], scale, (bounds[0][r], bounds[1][r]))

    def torch_block(r):
        want[r] = torch_scores(q[r], keys, w[r], scale, visible[r])

    run_blocks(kernel_block, q.shape[0], rows_k)
    run_blocks(torch_block, q.shape[0], rows_r)
    err = torch.where(visible, got - want, 0).abs().max().item()
    return err, torch.where(visible, want, 0).abs().max().item()


def main(argv: list[str] | None = None) -> None:
    from cpmoe.bench.timing import run_lengths
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default, which the engine keeps
    run_lengths("v4_indexer", parse_args(argv), indexer.triton is not None, bench_length)


if __name__ == "__main__":
    main()
