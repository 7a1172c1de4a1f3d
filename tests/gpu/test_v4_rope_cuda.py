"""DeepSeek-V4's in-place query norm + RoPE kernel (cpmoe.models.deepseek_v4.rope) on CUDA in
bf16 against the torch expressions it replaces (`unweighted_rms_norm`, then
`apply_interleaved_rope`; the inverse rotation with -sin). Skipped without a GPU; on the GPU
machine: `python3 -m pytest tests/gpu/test_v4_rope_cuda.py -q`.

V4's shapes (64 heads of 512, 64 rotated channels), T = 1000. Both round the norm's scale and
product to bf16 and the rotation once; the mean of squares is summed in another order, so
the scale may be one bf16 ulp off: elementwise within two ulps (2^-6) of the row's largest
value. The inverse rotation leaves the 448 unrotated channels bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.models.deepseek_v4.rope import head_norm_rope_
from cpmoe.models.layers import apply_interleaved_rope, unweighted_rms_norm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(T: int = 1000, h: int = 64, D: int = 512, half: int = 32):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, h, D, generator=g) * 3).to("cuda", torch.bfloat16)
    freqs = torch.arange(T)[:, None] * (1e4 ** (-torch.arange(half) / half))[None, :]
    return x, freqs.cos().to("cuda", torch.bfloat16), freqs.sin().to("cuda", torch.bfloat16)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs()
    bound = 2.0 ** -6 * want.float().abs().amax(-1, keepdim=True)
    assert (err <= bound).all(), (err - bound).max().item()


@cuda
def test_head_norm_rope_matches_torch_expressions_in_bf16() -> None:
    x, cos, sin = _inputs()
    want = apply_interleaved_rope(unweighted_rms_norm(x, 1e-6), cos, sin)
    _check(head_norm_rope_(x, cos, sin, 1e-6), want)


@cuda
def test_inverse_rope_matches_torch_expression_in_bf16() -> None:
    x, cos, sin = _inputs()
    want = apply_interleaved_rope(x, cos, -sin)
    got = head_norm_rope_(x.clone(), cos, sin, 1e-6, norm=False, sin_sign=-1.0)
    _check(got, want)
    assert torch.equal(got[..., :448], x[..., :448])
