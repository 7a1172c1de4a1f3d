"""Fixtures shared by the CUDA tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def exact_fp32_matmul():
    """fp32 matmuls in full fp32 (no TF32) for the test: the references many CUDA tests
    compare 16-bit kernels against are fp32, and their bounds assume it."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved
