"""Triton for the modules with kernels, or None where no kernel of theirs can run.

A kernel runs on a CUDA (or ROCm) device, or on CPU in Triton's interpreter
(TRITON_INTERPRET=1, which Triton reads at its import). With a CPU-only build of torch and
no interpreter nothing calls one, so Triton is not imported: that import alone costs about a
quarter of a CPU-second in every process (each CPU rank, each CLI call).
"""

from __future__ import annotations

import os

import torch


def import_triton():
    """-> (triton, triton.language), or (None, None): not installed, or no kernel can run."""
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    if not gpu_build and os.environ.get("TRITON_INTERPRET") != "1":
        return None, None
    try:
        import triton
        import triton.language as tl
    except ImportError:  # CPU-only installs
        return None, None
    return triton, tl
