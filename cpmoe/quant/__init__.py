"""FP8 weights: checkpoint formats (formats.py), layout rules (layout.py), FP8 modules and
their CUDA kernels (modules.py, kernels.py)."""
