"""Top-k routers (weights replicated on every rank; routing is a pure function of the row).

Qwen2/3-MoE: softmax over expert logits in fp32, top-k, renormalise when `norm_topk_prob`,
weights cast back to the activation dtype -- the order of operations of HF transformers (on
CUDA in one Triton pass, `ops.softmax_topk`, which breaks exact ties toward the lower expert
id; torch.topk leaves their order unspecified).

Legend: N = tokens, H = hidden, E = experts, K = top-k.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe.linear import param
from cpmoe.ops import softmax_topk


class SoftmaxTopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = param(num_experts, hidden_size, dtype=dtype)
        self.calibration = None  # moe.uniform_routing: redraw the weight from the next rows

    def forward(self, x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (topk_ids_NK int64 global expert ids, topk_weights_NK in x's dtype)."""
        if self.calibration is not None:
            self.calibration.redraw(self.weight, x_NH)
        return softmax_topk(F.linear(x_NH, self.weight), self.top_k, self.norm_topk_prob,
                            x_NH.dtype)
