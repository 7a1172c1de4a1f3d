"""Fused kernels of the model, one Triton kernel each on CUDA and the plain torch expression
(the reference the kernels are tested against) everywhere else; the lowest floor under the
layers (cp, moe, linear) and the FP8 modules (quant).

- `launch`: where kernels run (`use_triton`) and dependent launch (`pdl_args`,
  `wait_for_producer`).
- `activation`: `silu_and_mul`, `clamped_swiglu`, `weighted_row_sum` (the MoE combine).
- `norm`: `norm_rope` (`norm_rope_fp8`: in e4m3 for FP8 attention), `qkv_norm_rope_store`
  (with `to_kv_cache` / `kv_max` and a layer's K/V scales: `unit_kv_scale`,
  `fill_kv_scale`), `add_rms_norm`, `rms_norm_fp32_weight`.
- `routing`: `softmax_topk` (the Qwen router after its matmul).
- `merge`: `merge_partials`, `merge_two_attention` (partial attention over disjoint keys).
- `fp8`: FP8 formats and scale arithmetic, `quantize_act` / `swiglu_quantize` and the rows
  a kernel offers already quantized.
- `fp8_gemm`: `fp8_linear`, `fp8_linear_skinny`, `grouped_fp8_gemm`.

The names below are the ops the layers call. Kernels accumulate in fp32 and round once.
Triton is optional: without it (or on CPU) the torch expressions run. Legend: T/M rows,
H hidden, K top-k, I intermediate, D head dim.
"""

from cpmoe.ops.activation import (clamped_swiglu, clamped_swiglu_ref, silu_and_mul,
                                  silu_and_mul_ref, weighted_row_sum, weighted_row_sum_ref)
from cpmoe.ops.launch import pdl_args, triton, use_triton
from cpmoe.ops.merge import merge_partials, merge_two_attention
from cpmoe.ops.norm import (add_rms_norm, add_rms_norm_ref, fill_kv_scale, kv_max, norm_rope,
                            norm_rope_fp8, norm_rope_fp8_ref, norm_rope_ref, qkv_norm_rope_store,
                            qkv_norm_rope_store_fp8, qkv_norm_rope_store_fp8_ref,
                            qkv_norm_rope_store_ref, rms_norm_fp32_weight, to_kv_cache,
                            unit_kv_scale)
from cpmoe.ops.routing import softmax_topk, softmax_topk_ref

__all__ = ["add_rms_norm", "add_rms_norm_ref", "clamped_swiglu", "clamped_swiglu_ref",
           "fill_kv_scale", "kv_max", "merge_partials", "merge_two_attention", "norm_rope",
           "norm_rope_fp8", "norm_rope_fp8_ref", "norm_rope_ref", "pdl_args", "qkv_norm_rope_store",
           "qkv_norm_rope_store_fp8", "qkv_norm_rope_store_fp8_ref", "qkv_norm_rope_store_ref",
           "rms_norm_fp32_weight", "silu_and_mul", "silu_and_mul_ref", "softmax_topk",
           "softmax_topk_ref", "to_kv_cache", "triton", "unit_kv_scale", "use_triton",
           "weighted_row_sum", "weighted_row_sum_ref"]
