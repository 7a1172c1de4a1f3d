"""The FP8 layout rule: no rank's shard may start inside a scale block.

A block-scaled weight is cut with its scales: a cut at row (or column) c of a weight takes
scale rows from c / bn, which exists only when c is a multiple of the block. The rule is
checked on the shards of rank 0 built on the meta device (every rank cuts at multiples of
the same piece size), before any rank starts; EP keeps experts whole and is the way out for
MoE-TP cuts (Qwen3-30B-A3B-FP8: 768 / moe_tp 4 = 192 is not a multiple of 128).
"""

from __future__ import annotations

import torch

from cpmoe.config import Fp8Config
from cpmoe.linear import Linear
from cpmoe.moe.experts import LocalExperts
from cpmoe.parallel.layout import LayoutError, ParallelLayout
from cpmoe.ops.fp8 import MXFP4_BLOCK

# Never block-quantized whatever modules_to_not_convert says: head and routers.
ALWAYS_DENSE = ("lm_head", "mlp.gate", "shared_expert_gate")


def converts(quant: Fp8Config, module_name: str) -> bool:
    return not module_name.endswith(ALWAYS_DENSE) and quant.converts(module_name)


def expert_block(quant: Fp8Config) -> tuple[int, int]:
    return MXFP4_BLOCK if quant.expert_dtype == "fp4" else quant.block


def check_fp8_layout(layout: ParallelLayout, cfg, model_cls: type) -> None:
    """LayoutError (one line: sizes, block, what to use instead) when `layout` cuts inside
    a scale block of any FP8 weight of `model_cls` at `cfg`."""
    from cpmoe.parallel.groups import ProcessGroups
    quant: Fp8Config = cfg.quantization
    with torch.device("meta"):
        model = model_cls(cfg, ProcessGroups.offline(layout, 0, "meta"), torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, LocalExperts) and module.shard[3] > 1:
            _check_experts(name, module, cfg, quant, layout)
        elif isinstance(module, Linear) and module.shard is not None and converts(quant, name):
            _check_linear(name, module, quant, layout)


def _check_experts(name: str, experts: LocalExperts, cfg, quant: Fp8Config,
                   layout: ParallelLayout) -> None:
    inter = experts.down_proj.shape[2]  # local intermediate: rows of gate/up, cols of down
    bn, bk = expert_block(quant)
    for b in (bn, bk):
        if inter % b:
            raise LayoutError(
                f"FP8 experts ({name}): moe_intermediate_size {cfg.moe_intermediate_size} / "
                f"moe_tp {layout.moe_tp_size} = {inter} is not a multiple of the scale block "
                f"{b} (weight blocks {list(expert_block(quant))}), so MoE-TP would cut inside "
                f"a block; keep experts whole with --ep-size (e.g. --ep-size "
                f"{layout.tp_size // layout.moe_dp_size})")


def _check_linear(name: str, module: Linear, quant: Fp8Config, layout: ParallelLayout) -> None:
    kind, _, parts = module.shard
    dim = 0 if kind == "rows" else 1
    n = module.weight.shape[dim]
    b = quant.block[dim]
    if n % b:
        what = "output rows" if dim == 0 else "input columns"
        raise LayoutError(
            f"FP8 weight {name}.weight: attention TP {layout.attn_tp_size} cuts its {what} "
            f"into pieces of {n}, not a multiple of the scale block {b} (weight blocks "
            f"{list(quant.block)}); use a smaller attention TP (a larger --attn-cp-size)")
