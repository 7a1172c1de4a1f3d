"""FP8 weights in the model: which modules keep them, and how they compute.

On CUDA, block-FP8 weights stay FP8 in memory and run FP8 GEMMs (kernels.py): a `Linear`
becomes an `Fp8Linear` (weight float8_e4m3fn [N, K] + weight_scale_inv float32
[ceil(N/bn), ceil(K/bk)]), and `LocalExperts` get FP8 `gate_up_proj` / `down_proj` with
`gate_up_scale_inv` [E, 2I/bn, H/bk] and `down_scale_inv` [E, H/bn, I/bk]; attention math,
norms, routers and the head stay in the compute dtype. A module keeps FP8 only where its
rank-local shard is whole blocks and the kernels take the block (bk a power of two >= 16);
everything else, every module on CPU, and MXFP4 experts are dequantized once at load.

- `prepare_fp8(model, names, quant)`: before loading an FP8 checkpoint, turn the modules
  whose checkpoint weights carry scales (`names`, parameter names) into FP8 modules; the
  loader then copies FP8 slices and scale slices as they are.
- `quantize_loaded(model, quant, keep_fp8)`: `--quantization fp8` after a 16-bit load:
  every convertible weight is quantized to blocks (quant.block, on the local shard); with
  keep_fp8 the modules become FP8 modules, otherwise the weights are replaced by their
  dequantized values (CPU: the model computes with FP8-rounded weights).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cpmoe.config import Fp8Config
from cpmoe.linear import Linear, param
from cpmoe.moe.experts import LocalExperts
from cpmoe.ops.fp8 import FP8, dequantize, quantize_block_fp8, scale_grid
from cpmoe.ops.fp8_gemm import fp8_linear, scaled_mm_weight_scale
from cpmoe.quant.layout import converts

# Linear modules whose weight a model reads directly (DeepSeek-V4's grouped output LoRA):
# they stay in the compute dtype.
DIRECT_WEIGHT_USERS = ("o_a_proj",)


class Fp8Linear(Linear):
    def __init__(self, linear: Linear, block: tuple[int, int]) -> None:
        nn.Module.__init__(self)
        N, K = linear.weight.shape
        dev = linear.weight.device
        self.weight = param(N, K, dtype=FP8, device=dev)
        self.weight_scale_inv = param(*scale_grid((N, K), block), dtype=torch.float32,
                                      device=dev)
        self.bias, self.shard, self.block = linear.bias, linear.shard, block
        self._mm_scale: tuple[tuple[int, int], torch.Tensor] | None = None  # (whose, padded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias,
                          self._scaled_mm_scale() if x.is_cuda else None)

    def _scaled_mm_scale(self) -> torch.Tensor:
        """The scales in scaled_mm's padded layout, made again only when they were written
        (the loader fills them after construction; decode graphs replay the eager ones)."""
        s = self.weight_scale_inv
        whose = (s.data_ptr(), s._version)
        if self._mm_scale is None or self._mm_scale[0] != whose:
            self._mm_scale = (whose, scaled_mm_weight_scale(s.detach()))
        return self._mm_scale[1]


def kernel_block_ok(block: tuple[int, int]) -> bool:
    bk = block[1]
    return bk >= 16 and bk & (bk - 1) == 0


def _linear_fits(linear: Linear, block: tuple[int, int]) -> bool:
    N, K = linear.weight.shape
    return kernel_block_ok(block) and N % block[0] == 0 and K % block[1] == 0


def _experts_fit(experts: LocalExperts, block: tuple[int, int]) -> bool:
    E, H, inter = experts.down_proj.shape
    return (kernel_block_ok(block) and inter % block[0] == 0 and inter % block[1] == 0
            and H % block[0] == 0 and H % block[1] == 0)


def make_fp8_experts(experts: LocalExperts, block: tuple[int, int]) -> None:
    """Swap the experts' weights for empty FP8 ones and add their scale grids."""
    E, H, inter = experts.down_proj.shape
    dev = experts.down_proj.device
    bn, bk = block
    experts.gate_up_proj = param(E, 2 * inter, H, dtype=FP8, device=dev)
    experts.down_proj = param(E, H, inter, dtype=FP8, device=dev)
    experts.gate_up_scale_inv = param(E, 2 * inter // bn, H // bk, dtype=torch.float32,
                                      device=dev)
    experts.down_scale_inv = param(E, H // bn, inter // bk, dtype=torch.float32, device=dev)
    experts.fp8_block = block


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def prepare_fp8(model: nn.Module, names: set[str], quant: Fp8Config) -> int:
    """-> the number of modules made FP8 (see the module docstring)."""
    count = 0
    rename = model.checkpoint_param_name
    hf_names = {rename(n) for n in names}
    for name, module in list(model.named_modules()):
        if isinstance(module, LocalExperts) and quant.expert_dtype == "fp8" \
                and f"{name}.0.gate_proj.weight" in hf_names and _experts_fit(module,
                                                                               quant.block):
            make_fp8_experts(module, quant.block)
            count += 1
        elif (type(module) is Linear and f"{name}.weight" in hf_names
              and not name.endswith(DIRECT_WEIGHT_USERS) and _linear_fits(module, quant.block)):
            _swap(model, name, Fp8Linear(module, quant.block))
            count += 1
    return count


@torch.no_grad()
def quantize_loaded(model: nn.Module, quant: Fp8Config, keep_fp8: bool) -> int:
    """-> the number of modules quantized (see the module docstring)."""
    count = 0
    block = quant.block
    for name, module in list(model.named_modules()):
        if isinstance(module, LocalExperts):
            gate_up, down = module.gate_up_proj.data, module.down_proj.data
            if keep_fp8 and _experts_fit(module, block):
                make_fp8_experts(module, block)
                for w, q, s in ((gate_up, module.gate_up_proj, module.gate_up_scale_inv),
                                (down, module.down_proj, module.down_scale_inv)):
                    for e in range(w.shape[0]):
                        q[e], s[e] = quantize_block_fp8(w[e], block)
            else:
                for w in (gate_up, down):
                    for e in range(w.shape[0]):
                        w[e] = dequantize(*quantize_block_fp8(w[e], block), block,
                                          dtype=w.dtype)
            count += 1
        elif type(module) is Linear and converts(quant, name) and \
                not name.endswith(DIRECT_WEIGHT_USERS):
            w = module.weight.data
            q, s = quantize_block_fp8(w, block)
            if keep_fp8 and _linear_fits(module, block):
                new = Fp8Linear(module, block)
                new.weight.copy_(q)
                new.weight_scale_inv.copy_(s)
                _swap(model, name, new)
            else:
                w.copy_(dequantize(q, s, block, dtype=w.dtype))
            count += 1
    return count


def fp8_input_group(module: nn.Module) -> int | None:
    """The group an FP8 module quantizes its input rows by (`quantize_act`, 1 x bk), or None
    for a module that reads them in 16 bits."""
    if isinstance(module, Fp8Linear):
        return module.block[1]
    block = getattr(module, "fp8_block", None) if isinstance(module, LocalExperts) else None
    return None if block is None else block[1]


def fp8_weight_bytes(model: nn.Module) -> int:
    """Bytes of FP8 weights and their scales held by a model shard."""
    total = 0
    for name, p in model.named_parameters():
        if p.dtype == FP8 or name.endswith("scale_inv"):
            total += p.numel() * p.element_size()
    return total


def planned_weight_bytes(model: nn.Module, quant: Fp8Config, dtype: torch.dtype
                         ) -> tuple[int, int]:
    """(all weight bytes, of which FP8 weights and scales) of a shard (built on the meta
    device) once FP8 on CUDA: modules that keep FP8 count 1 byte per weight plus float32
    scales; everything else (and MXFP4 experts, dequantized) stays in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    total = fp8 = 0
    counted: set[int] = set()
    for name, module in model.named_modules():
        params = []
        if isinstance(module, LocalExperts) and quant.expert_dtype == "fp8" \
                and _experts_fit(module, quant.block):
            params = [module.gate_up_proj, module.down_proj]
        elif (type(module) is Linear and converts(quant, name)
              and not name.endswith(DIRECT_WEIGHT_USERS) and _linear_fits(module, quant.block)):
            params = [module.weight]
        for p in params:
            grid = scale_grid(tuple(p.shape[-2:]), quant.block)
            n = p.numel() + 4 * grid[0] * grid[1] * (p.shape[0] if p.dim() == 3 else 1)
            fp8 += n
            counted.add(id(p))
    for p in model.parameters():
        if id(p) not in counted:
            total += p.numel() * (size if p.is_floating_point() and p.dtype != torch.float32
                                  else p.element_size())
    return total + fp8, fp8
