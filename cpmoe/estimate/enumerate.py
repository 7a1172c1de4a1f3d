"""Every layout of N GPUs that `cpmoe plan` would accept for a model, for the estimate.

One replica spans the N GPUs (attention DP is 1, so tp = N). The candidates are every
attention CP width and EP width dividing N, MoE DP 1 (decoupled) or equal to CP (coupled),
and the MoE backends `none` and `alltoall_padded`. Left out: `alltoall` (its count exchange
syncs the host every layer, so decode runs without CUDA graphs, and neither cost is in the
model; it measured the slowest backend, BENCHMARKS.md), deepep and mori (no adapter in cpmoe:
`cpmoe plan` accepts them only where their package is installed, and nothing runs them). Each candidate is kept only if building its
`ParallelLayout` and `check_model_fit` (the two checks `cpmoe plan` runs) both pass. The CP
strategy is zigzag: interleave is the masked fallback on CUDA, which nothing here measured.
"""

from __future__ import annotations

from cpmoe.models.registry import check_model_fit
from cpmoe.parallel.layout import LayoutError, ParallelLayout

ESTIMATED_BACKENDS = ("none", "alltoall_padded")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(gpus: int, cfg) -> list[ParallelLayout]:
    """Layouts of `gpus` ranks that pass the layout's and the model's checks, in a fixed
    order (CP, then MoE DP, then EP, then backend)."""
    out = []
    for cp in divisors(gpus):
        for dp in sorted({1, cp}):
            for ep in divisors(gpus):
                for backend in ESTIMATED_BACKENDS:
                    try:
                        layout = ParallelLayout(tp_size=gpus, attn_cp_size=cp, moe_dp_size=dp,
                                                ep_size=ep, moe_a2a_backend=backend)
                        check_model_fit(layout, cfg)
                    except LayoutError:
                        continue
                    out.append(layout)
    return out
