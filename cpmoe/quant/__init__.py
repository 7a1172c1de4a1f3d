"""FP8 weights: checkpoint formats and dequantization (formats.py), the rule that layouts
cut on block boundaries (layout.py), FP8 modules and online quantization (modules.py),
the FP8 experts branch (experts.py) and the CUDA kernels (kernels.py)."""
