"""DeepSeek-V4's hyper-connection kernels (cpmoe.models.deepseek_v4.hyper_connection) in Triton's CPU
interpreter against the torch expressions of their formulas written here (a subprocess:
TRITON_INTERPRET is read at import; skipped without Triton), the model's kernel branch
(forced on in float32) against its torch branch, and the input checks.

Cases: hc 4 and 2; T odd and not a multiple of the row block; H 300 and 70 (not multiples of
the column block) and 64 (below one block); strided h (rows wider than hc x H), out a column
slice, post a column slice of a wider tensor, comb transposed in memory; a bf16 case.

Tolerance, elementwise, from fp32 rounding (u = 2^-24): kernel and float32 reference each
sum hc + 1 products in some order, off by at most (hc + 2) u S each, where S is the same sum
of absolute values (merge: post |out| + sum_i comb_ij |h_i|; collapse: sum_i pre_i |h_i|),
so |kernel - ref| <= 2 (hc + 2) u S. bf16: the kernel rounds once to bf16; the interpreter
truncates where the GPU rounds, one ulp 2^-7 |ref| more. A transposed comb or a wrong
stream moves outputs by a fair share of S, thousands of times the float32 bound (checked).
hc_mix against float64: an fp32 sum of K = hc H products is off by at most K u S (S = r
sum_k |h_k| |fn_k|), r by (K / 2 + 4) u, so |mix - ref| <= 2 (K + 8) u S. Cases: N 24 (V4's
(2 + hc) hc, padded to 32) and 2 and 4 (the head's hc, padded to 16), partial row and k
blocks, fn rows wider than K, a zero row, bf16 h (exact in float32).
hc_weights against float64 formulas: each output within 1e-5 relative (sigmoid, softmax and
20 Sinkhorn sweeps in float32; the entries are >= eps, far from 0).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.models.deepseek_v4 import hyper_connection as hc
from tests._interpreter import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton not installed")

_KERNELS = r"""
import torch
from cpmoe.models.deepseek_v4.hyper_connection import hc_collapse, hc_merge, hc_mix, hc_weights

g = torch.Generator().manual_seed(0)
U = 2.0 ** -24


def inputs(T, c, H, dtype):
    h = torch.randn(T, c * H + 5, generator=g).to(dtype)[:, 3:3 + c * H].view(T, c, H)
    out = torch.randn(T, H + 7, generator=g).to(dtype)[:, 7:]
    post = (2 * torch.rand(T, 3 * c, generator=g))[:, c:2 * c]
    comb = torch.softmax(torch.randn(T, c, c, generator=g), -1).transpose(1, 2)
    assert h.stride(0) != c * H and post.stride(0) != c and not comb.is_contiguous()
    return h, out, post, comb


def check(got, want, S, c, dtype):
    bound = 2 * (c + 2) * U * S
    if dtype != torch.float32:
        bound = bound + 2.0 ** -7 * want.abs()
    err = (got.float() - want).abs()
    assert got.dtype == dtype and got.shape == want.shape
    assert (err <= bound).all(), (tuple(want.shape), dtype, (err - bound).max().item())
    return bound


def merge_case(T, c, H, dtype=torch.float32, **tiles):
    h, out, post, comb = inputs(T, c, H, dtype)
    hf, of = h.float(), out.float()
    want = post[..., None] * of[:, None, :] + torch.einsum("tij,tih->tjh", comb, hf)
    S = post[..., None] * of.abs()[:, None, :] + torch.einsum("tij,tih->tjh", comb, hf.abs())
    got = hc_merge(h, out, post, comb, **tiles)
    bound = check(got, want, S, c, dtype)
    untransposed = post[..., None] * of[:, None, :] + torch.einsum("tji,tih->tjh", comb, hf)
    if dtype == torch.float32:
        assert (untransposed - want).abs().max() > 1000 * bound.max()
    return (got.float() - want).abs().max().item()


def collapse_case(T, c, H, dtype=torch.float32, **tiles):
    h, _, pre, _ = inputs(T, c, H, dtype)
    hf = h.float()
    want = (pre[..., None] * hf).sum(1)
    S = (pre[..., None] * hf.abs()).sum(1)
    got = hc_collapse(h, pre, **tiles)
    bound = check(got, want, S, c, dtype)
    if dtype == torch.float32:  # stream 0 alone
        assert (hf[:, 0] * pre[:, :1] - want).abs().max() > 1000 * bound.max()
    return (got.float() - want).abs().max().item()


def mix_case(T, c, H, N, dtype=torch.float32, eps=1e-6, **tiles):
    h = torch.randn(T, c * H, generator=g).to(dtype).view(T, c, H)
    h[1] = 0  # the mix is 0, r = eps^-1/2
    fn = torch.randn(N, c * H + 3, generator=g)[:, 3:]  # row stride wider than c H
    hd, fd = h.double().flatten(1), fn.double()
    r = torch.rsqrt(hd.square().mean(-1, keepdim=True) + eps)
    want = (hd @ fd.T) * r
    S = (hd.abs() @ fd.abs().T) * r
    got = hc_mix(h, fn, eps, **tiles)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    err = (got.double() - want).abs()
    bound = 2 * (c * H + 8) * U * S
    assert (err <= bound + 1e-30).all(), (err - bound).max().item()
    return err.max().item()


def weights_case(T, c, iters, **tiles):
    eps = 1e-6
    mix = torch.randn(T, (2 + c) * c + 5, generator=g)[:, 5:] * 3  # rows wider than N
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + c) * c, generator=g)
    m, b = mix.double() * 1, base.double()
    pre = torch.sigmoid(m[:, :c] * scale[0].item() + b[:c]) + eps
    post = 2 * torch.sigmoid(m[:, c:2 * c] * scale[1].item() + b[c:2 * c])
    comb = torch.softmax(m[:, 2 * c:].view(T, c, c) * scale[2].item() + b[2 * c:].view(c, c),
                         dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    got = hc_weights(mix, scale, base, iters, eps, **tiles)
    errs = []
    for a, want in zip(got, (pre, post, comb)):
        assert a.dtype == torch.float32 and a.shape == want.shape and a.is_contiguous()
        err = ((a.double() - want).abs() / want.abs()).max().item()
        assert err <= 1e-5, err
        errs.append(err)
    return max(errs)


results = [
    merge_case(7, 4, 300),  # 2 x 2 tiles, both partial
    merge_case(5, 2, 70, block_t=2, block_h=32),  # 3 x 3 tiles
    merge_case(3, 4, 64),
    merge_case(9, 4, 100, dtype=torch.bfloat16, block_h=64),
    collapse_case(7, 4, 300),
    collapse_case(5, 2, 70, block_t=2, block_h=32),
    collapse_case(9, 4, 100, dtype=torch.bfloat16, block_h=64),
    mix_case(37, 4, 100, 24),  # 2 row blocks, the last partial; K 400: a partial k block
    mix_case(5, 2, 70, 2, block_t=16, block_k=32),
    mix_case(70, 4, 100, 24, block_t=64, block_k=32),  # prefill's tiles (MIX_TILES)
    mix_case(9, 4, 64, 4, dtype=torch.bfloat16),
    weights_case(70, 4, 20),  # 2 row blocks, the last partial
    weights_case(5, 2, 3, block_t=2),
]
print("hc kernels ok", results)
"""


@needs_triton
def test_kernels_match_torch_formulas_in_the_interpreter() -> None:
    out = run_interpreted(_KERNELS, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hc kernels ok" in out.stdout


_MIX = r"""
import torch
import torch.nn.functional as F
from cpmoe.models.deepseek_v4.model import _flat_rms
from cpmoe.models.deepseek_v4.hyper_connection import hc_mix

g = torch.Generator().manual_seed(0)
T, c, H, eps = 5, 4, 4096, 1e-6
h = torch.randn(T, c, H, generator=g) * torch.rand(T, 1, 1, generator=g) * 4
fn = torch.randn(6 * c, c * H, generator=g) * (c * H) ** -0.5
today = F.linear(_flat_rms(h, eps), fn)
got = hc_mix(h, fn, eps)
err = (got - today).abs().max().item()
assert err <= 1e-5, err
print("mix ok", err, today.abs().max().item())
"""


@needs_triton
def test_mix_with_the_rms_after_the_linear_is_within_1e5_of_flat_rms() -> None:
    """At V4's default width (hc 4 x H 4096) in float32, hc_mix(h, fn) (what the CUDA
    16-bit path computes, here on float32 h) is within 1e-5 of today's
    F.linear(_flat_rms(h), fn), mix values of order 1."""
    out = run_interpreted(_MIX, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mix ok" in out.stdout


_MODEL = r"""
import torch
from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4 import model as v4
from cpmoe.models.deepseek_v4 import hyper_connection as hc
from cpmoe.parallel.groups import ProcessGroups
from tests._v4_tiny import tiny_v4

TINY_V4 = tiny_v4(hc_mult=4)
gen = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (150, 41, 1)]


def run():
    runner = ModelRunner.from_config(TINY_V4, ProcessGroups.single("cpu"), torch.float32,
                                     seed=0)
    runner.allocate_kv(300)
    prefill = runner.prefill(seqs, [0, 1, 2])
    return prefill, runner.decode([0, 1, 2], [5, 6, 7])


want = run()
calls = {}
for name in ("hc_merge", "hc_collapse", "hc_mix", "hc_weights"):
    def spy(*a, _f=getattr(hc, name), _n=name, **k):
        calls[_n] = calls.get(_n, 0) + 1
        return _f(*a, **k)
    setattr(v4, name, spy)
v4.kernel_applies = lambda device, dtype: True  # the CUDA branch, here in float32
got = run()
# per forward: 3 layers x 2 hyper-connections, then the head (prefill, then one decode)
assert calls == {"hc_merge": 12, "hc_collapse": 14, "hc_mix": 14, "hc_weights": 12}, calls
for a, b in zip(got, want):
    err, top = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= 1e-5 * top, (err, top)
print("model hc kernel branch ok", calls)
"""


@needs_triton
def test_model_kernel_branch_matches_torch_branch_in_the_interpreter() -> None:
    """A tiny V4 (hc 4, hidden 64: one partial column block) in float32 with the hc kernels
    forced on (every hyper-connection and the hyper head, in prefill and a decode step)
    gives the torch branch's logits within 1e-5 of their largest (fp32 summation order
    only)."""
    out = run_interpreted(_MODEL, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "model hc kernel branch ok" in out.stdout


def test_bad_inputs_raise_one_line_errors() -> None:
    h, out = torch.randn(3, 4, 16), torch.randn(3, 16)
    post, comb = torch.rand(3, 4), torch.rand(3, 4, 4)
    cases = [
        (hc.hc_merge, (h[:, :, 0], out, post, comb), r"need h \[T, hc, H\]"),
        (hc.hc_merge, (h.transpose(1, 2), out, post, comb), "contiguous last axis"),
        (hc.hc_merge, (h[:, :3], out, post[:, :3], comb[:, :3, :3]), "power of two"),
        (hc.hc_merge, (h, out, post.double(), comb), r"need post float32 \(3, 4\)"),
        (hc.hc_merge, (h, out, post, comb[:, :2]), r"need comb float32 \(3, 4, 4\)"),
        (hc.hc_merge, (h, out.half(), post, comb), r"need out torch.float32 \(3, 16\)"),
        (hc.hc_merge, (h, out.t().contiguous().t(), post, comb), "contiguous last axis"),
        (hc.hc_collapse, (h, post[:2]), r"need pre float32 \(3, 4\)"),
        (hc.hc_mix, (h[:, :, :8], torch.rand(24, 32), 1e-6), "need flat h rows"),
        (hc.hc_mix, (h, torch.rand(24, 64).double(), 1e-6), r"fn float32 \[N, 64\]"),
        (hc.hc_weights, (torch.rand(3, 20), torch.rand(3), torch.rand(20), 2, 1e-6),
         r"mix float32 \[T, \(2 \+ hc\) hc\]"),
        (hc.hc_weights, (torch.rand(3, 24), torch.rand(3), torch.rand(20), 2, 1e-6),
         r"need scale \[3\] and base \[24\]"),
    ]
    for fn, args, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            fn(*args)
        assert "\n" not in str(info.value)


def test_benchmark_references_are_the_models_torch_branches_and_cli_on_cpu() -> None:
    """bench.v4_hyper_connection times what the model runs without the kernels: its
    `torch_merge` and `torch_collapse` on bf16 inputs equal `DeepseekV4HyperConnection.merge`
    and the collapse it shares with the hyper head (on CPU: the torch branches) bit for
    bit; its floor counts h and out once each way; its arguments parse; without CUDA it
    exits with one clear line."""
    from bench import v4_hyper_connection as bench
    from cpmoe.models.deepseek_v4 import model as v4

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 4, 24, generator=g).bfloat16()
    out = torch.randn(5, 24, generator=g).bfloat16()
    post, pre = 2 * torch.rand(5, 4, generator=g), torch.rand(5, 4, generator=g)
    comb = torch.softmax(torch.randn(5, 4, 4, generator=g), -1)
    want = v4.DeepseekV4HyperConnection.merge(h, out, post, comb)
    assert torch.equal(bench.torch_merge(h, out, post, comb), want)
    assert torch.equal(bench.torch_collapse(h, pre), v4._collapse(h, pre))
    assert bench.floor_bytes(16384, 4, 4096, 2) == {
        "merge": 2 * 2 ** 29 + 2 ** 27, "collapse": 2 ** 29 + 2 ** 27, "mix": 2 ** 29}
    a = bench.parse_args(["--lengths", "1024", "--sweep"])
    assert (a.lengths, a.hidden, a.hc, a.hbm_tbs, a.sweep) == ("1024", 4096, 4, 4.8, True)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--lengths", "128"])
