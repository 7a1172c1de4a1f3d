"""Router weights drawn so that expert load is near-uniform (`--routing uniform`).

Random weights route unevenly: hidden states of one prompt share a large common component
(attention over random keys averages toward the same vector), so the router's logits carry
a per-expert constant and a few experts take most slots (BENCHMARKS.md: 8 experts took 79%
of a prefill layer's slots). A trained router is balanced on average by its auxiliary
loss. To benchmark at that balance, each layer's router is redrawn from the statistics of
its own inputs during one calibration forward, layer by layer (a layer's input depends on
the routers before it):

    mean m and covariance C of the router's input rows (over every rank: the sums are
    all-reduced, so every rank draws the same weights)
    W = G' C^-1/2 with G ~ N(0, 1) [E, H] seeded by the layer, G' = G with the direction
    C^-1/2 m projected out of every row and every row scaled to norm 1

so W m = 0 (no per-expert constant) and every expert's logit has unit variance over the
calibration rows: each expert is equally likely to be in a row's top-k.

That removes the common component of the calibration prompts, not the one of each new
prompt (which differs from prompt to prompt). So the weights that write into the residual
stream (`o_proj`, `down_proj` of dense, shared and routed experts) are first scaled by
RESIDUAL_SCALE: the token's own embedding then dominates every layer's input and routing
follows the token. Measured on a 4-layer, 64-expert random model (tests/unit/
test_uniform_routing.py): busiest expert / mean over 32 prompts 1.6-2.9 as drawn, 1.2-2.1
with calibration alone, 1.15-1.22 with both. Shapes, FLOPs and bytes are unchanged; only
values: any engine given the same weights (HF transformers in the benchmarks) routes the
same way (`residual_scaled` names the tensors to scale there).

Legend: N rows, H hidden, E experts.
"""

from __future__ import annotations

import re

import torch

from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups

RESIDUAL_SCALE = 0.1
_RESIDUAL_WRITERS = re.compile(r"\.(o_proj|down_proj)(\.weight)?$")


def residual_scaled(name: str) -> bool:
    """Whether a parameter (cpmoe or HF transformers 5 name) writes into the residual."""
    return _RESIDUAL_WRITERS.search(name) is not None


class RouterCalibration:
    """Installed on a router (`router.calibration`) for one forward: redraws its weight from
    the rows it sees, then routes with the new weight."""

    def __init__(self, layer: int, groups: ProcessGroups, seed: int) -> None:
        self.layer, self.groups, self.seed = layer, groups, seed

    def redraw(self, weight: torch.Tensor, x_NH: torch.Tensor) -> None:
        x = x_NH.double()
        real = (x.abs().sum(dim=1) > 0).double()  # padded rows of a split are all zeros
        stats = torch.cat([real.sum()[None], x.sum(dim=0), (x.T @ x).flatten()])
        stats = comm.all_reduce(stats, self.groups.world)
        H = x.shape[1]
        n, s, ss = stats[0], stats[1:H + 1], stats[H + 1:].view(H, H)
        mean = s / n
        cov = ss / n - torch.outer(mean, mean)
        # float32 on the GPU (an fp64 eigh of 2048^2 takes seconds per layer on a CPU)
        cov = cov.float() if cov.is_cuda else cov
        evals, evecs = torch.linalg.eigh(cov)
        inv_sqrt = (evecs * evals.clamp(min=1e-6 * evals.max()).rsqrt()) @ evecs.T
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.layer)
        g = torch.randn(weight.shape, generator=gen, dtype=torch.float64).to(cov)
        u = inv_sqrt @ mean.to(cov)
        u = u / u.norm().clamp(min=1e-30)
        g = g - torch.outer(g @ u, u)
        g = g / g.norm(dim=1, keepdim=True)
        weight.copy_((g @ inv_sqrt).to(weight.device, weight.dtype))


def block_scales_of(model: torch.nn.Module, param_name: str) -> torch.Tensor:
    """The scale grid of an FP8 weight parameter (scaling it scales the weight): an FP8
    linear's `weight` has its `weight_scale_inv`, FP8 experts' `X_proj` their
    `X_scale_inv` (`quant.modules`' names)."""
    prefix, _, attr = param_name.rpartition(".")
    module = model.get_submodule(prefix)
    return getattr(module, "weight_scale_inv" if attr == "weight"
                   else attr.removesuffix("_proj") + "_scale_inv")


def calibrate_uniform_routing(model, groups: ProcessGroups, run_forward, seed: int = 0
                              ) -> int:
    """Scale the residual writers, then redraw every routed layer's router during one
    forward (`run_forward()`: a prefill of many short random prompts) -> the number of
    routers redrawn."""
    from cpmoe.moe.router import SoftmaxTopKRouter
    with torch.no_grad():
        for name, param in model.named_parameters():
            if residual_scaled(name) and param.dtype == torch.float8_e4m3fn:
                block_scales_of(model, name).mul_(RESIDUAL_SCALE)  # FP8: scale the scales
            elif residual_scaled(name):
                param.mul_(RESIDUAL_SCALE)
    routers = [m for m in model.modules() if isinstance(m, SoftmaxTopKRouter)]
    for layer, router in enumerate(routers):
        router.calibration = RouterCalibration(layer, groups, seed)
    try:
        run_forward()
    finally:
        for router in routers:
            router.calibration = None
    return len(routers)


def calibrate_on_random_prompts(runner, prompts: int = 64, length: int = 64,
                                seed: int = 0) -> int:
    """`calibrate_uniform_routing` on a prefill of random prompts (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 7)
    ids = torch.randint(0, runner.config.vocab_size, (prompts, length), generator=gen).tolist()
    return calibrate_uniform_routing(runner.model, runner.groups,
                                     lambda: runner.prefill(ids, last_only=True), seed)
