"""Top-k picks of the V4 indexer's scores on the GPU: a stable descending sort (the picks'
reference order) against torch.topk over fp32 scores and over the int64 order keys that
`indexer.indexer_topk` ranks (unique keys, so topk is deterministic and picks
what the sort picks), at row-block shapes of a 64K-token prefill (16384 CSA entries, top-512).

    python3 -m bench.topk_probe > bench/results/topk-probe-<commit>.log

Rows of unit-normal scores, half of each row -inf (causally hidden) and 100 exact zeros
(ties); milliseconds per call, CUDA events, mean of 20 after one untimed call.
"""

from __future__ import annotations

import torch

from cpmoe.bench.timing import cuda_ms

SHAPES = [(341, 16384, 512), (1024, 16384, 512), (341, 4096, 512), (2048, 8192, 512)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench.topk_probe needs a CUDA GPU")
    torch.manual_seed(0)
    for rows, E, k in SHAPES:
        s = torch.randn(rows, E, device="cuda")
        s[:, E // 2:] = float("-inf")
        s[:, :100] = 0.0
        low = 2 ** 31 - torch.arange(E, device="cuda")
        key = (s.view(torch.int32).to(torch.int64) << 32) | low
        runs = {
            "sort_stable": lambda: s.sort(dim=-1, descending=True, stable=True).indices[:, :k],
            "topk_sorted": lambda: s.topk(k, dim=-1),
            "topk_unsorted": lambda: s.topk(k, dim=-1, sorted=False),
            "topk_int64": lambda: key.topk(k, dim=-1, sorted=False),
            "sort_half": lambda: s[:, :E // 2].sort(dim=-1, descending=True, stable=True),
        }
        for name, fn in runs.items():
            print(rows, E, k, name, f"{cuda_ms(fn, 20):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
