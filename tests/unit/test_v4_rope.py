"""DeepSeek-V4's in-place query norm + interleaved RoPE kernel (cpmoe.models.deepseek_v4.rope)
in Triton's CPU interpreter against torch float32 formulas written here (a subprocess:
TRITON_INTERPRET is read at import; skipped without Triton), and the model's kernel branch
(forced on in float32) against its torch branch.

Cases: D 64 with R 16 (head blocks partial: h 6 at block 4), D 40 with R 40 (every channel
rotated; D not a power of two), strided x (a head slice of wider rows, rows padded), the
inverse rotation (norm off, -sin) which must leave the unrotated channels bit-identical,
and bf16 with the reference's roundings (scale and product to bf16, the rotation once).

Tolerance: float32, the kernel sums D squares in another order (at most D u relative on the
mean, u = 2^-24, half of it on the scale) and the rotation adds two products (a few u), so
|err| <= (D + 8) u (max |out| of the row + 1) is generous. bf16: where the reference's
roundings and the interpreter's (which truncates) may differ, two ulps of the row's largest
value (a scale an ulp off moves every product; a rotated channel's two rounded products may
cancel). A swapped pair or a wrong sign is off by a fair share of the row's values.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.models.deepseek_v4 import rope
from tests._interpreter import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton not installed")

_KERNEL = r"""
import torch
from cpmoe.models.deepseek_v4.rope import head_norm_rope_

g = torch.Generator().manual_seed(0)
U = 2.0 ** -24


def reference(x, cos, sin, eps, norm, sign):
    # float32 math, rounded to x's dtype where the torch expressions round
    dt = x.dtype
    xf = x.float()
    if norm:
        scale = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps).to(dt).float()
        xf = (xf * scale).to(dt).float()
    half = cos.shape[-1]
    c, s = cos.float()[:, None, :], sign * sin.float()[:, None, :]
    a, b = xf[..., -2 * half::2], xf[..., -2 * half + 1::2]
    out = xf.clone()
    out[..., -2 * half::2] = (a * c - b * s).to(dt).float()
    out[..., -2 * half + 1::2] = (b * c + a * s).to(dt).float()
    return out


def case(T, h, D, half, dtype=torch.float32, norm=True, sign=1.0, block_heads=4):
    wide = (torch.randn(T, h + 2, D + 3, generator=g) * 3).to(dtype)
    x = wide[:, 1:1 + h, :D]
    assert x.stride(2) == 1 and not x.is_contiguous()
    pos = torch.arange(T, dtype=torch.float32) * 7
    freqs = pos[:, None] * (1e4 ** (-torch.arange(half) / half))[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    want = reference(x, cos, sin, 1e-6, norm, sign)
    before, outside = x.clone(), wide[:, 0].clone()
    got = head_norm_rope_(x, cos, sin, 1e-6, norm=norm, sin_sign=sign, block_heads=block_heads)
    assert got.data_ptr() == x.data_ptr() and got.dtype == dtype
    err = (got.float() - want).abs()
    if dtype == torch.float32:
        scale = want.abs().amax(-1, keepdim=True) + 1
        bound = (D + 8) * U * scale
    else:
        bound = 2.0 ** -6 * want.abs().amax(-1, keepdim=True)
    assert (err <= bound).all(), (T, h, D, half, dtype, norm, (err - bound).max().item())
    assert torch.equal(wide[:, 0], outside)  # other heads untouched
    if not norm:  # unrotated channels untouched
        assert torch.equal(got[..., :D - 2 * half], before[..., :D - 2 * half])
    return err.max().item()


results = [
    case(5, 6, 64, 8),
    case(3, 2, 40, 20, block_heads=2),
    case(4, 6, 64, 8, norm=False, sign=-1.0),
    case(7, 5, 64, 8, dtype=torch.bfloat16),
    case(3, 4, 64, 8, dtype=torch.bfloat16, norm=False, sign=-1.0),
]
print("head norm rope ok", results)
"""


@needs_triton
def test_head_norm_rope_matches_float32_formula_in_the_interpreter() -> None:
    out = run_interpreted(_KERNEL, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "head norm rope ok" in out.stdout


_MODEL = r"""
import torch
from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4 import attention as att
from cpmoe.models.deepseek_v4 import rope
from cpmoe.parallel.groups import ProcessGroups
from tests._v4_tiny import tiny_v4

gen = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (150, 41, 1)]


def run():
    runner = ModelRunner.from_config(tiny_v4(hc_mult=4), ProcessGroups.single("cpu"),
                                     torch.float32, seed=0)
    runner.allocate_kv(300)
    prefill = runner.prefill(seqs, [0, 1, 2])
    return prefill, runner.decode([0, 1, 2], [5, 6, 7])


want = run()
calls = []
real = rope.head_norm_rope_


def spy(*a, **k):
    calls.append(k.get("norm", True))
    return real(*a, **k)


att.head_norm_rope_ = spy
att._rope_in_place = lambda x: True  # the CUDA branch, here in float32
got = run()
# per forward: 3 layers x the query norm + rope (norm on); the KV rows', the pooled
# entries', the indexer queries' and the output's rotations (norm off)
assert calls.count(True) == 6 and len(calls) >= 6 * 3 + 2 * 3, calls
for a, b in zip(got, want):
    err, top = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= 1e-5 * top, (err, top)
print("model rope kernel branch ok")
"""


@needs_triton
def test_model_rope_kernel_branch_matches_torch_branch_in_the_interpreter() -> None:
    """The tiny V4 in float32 with every in-place RoPE forced on (query norm + RoPE, the KV
    rows', pooled entries' and indexer queries' RoPE, the output's inverse; prefill and a
    decode step) gives the torch branch's logits within 1e-5 of their
    largest (fp32 summation order only)."""
    out = run_interpreted(_MODEL, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model rope kernel branch ok" in out.stdout


def test_bad_inputs_raise_one_line_errors() -> None:
    x, cos = torch.randn(3, 4, 16), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"need x \[T, h, D\]"):
        rope.head_norm_rope_(x[:, :, ::2], cos, cos, 1e-6)
    with pytest.raises(ValueError, match=r"need cos and sin"):
        rope.head_norm_rope_(x, torch.randn(3, 9), torch.randn(3, 9), 1e-6)
