"""DeepSeek-V4's hyper-connection kernels (cpmoe.models.deepseek_v4.hyper_connection) on CUDA in 16 bits
against float32 torch on the same values, and the bf16 V4 model with them against float32.
Skipped without a GPU; on the GPU machine:
`python3 -m pytest tests/gpu/test_v4_hyper_connection_cuda.py -q -s`.

Shapes: V4's (hc 4, H 4096) and H 4000 (a partial column block), T = 4097 rows (a partial
row block).

Tolerance, elementwise, with u = 2^-8 for bf16 and 2^-11 for fp16 (round to nearest, with
a factor 2 to spare): the kernels sum in float32 and round once, so |kernel - ref| <=
u |ref| + 2 (hc + 2) 2^-24 S, S the sum of the absolute terms (merge: post |out| +
sum_i comb_ij |h_i|; collapse: sum_i pre_i |h_i|). The torch
bf16 merge (post and comb rounded to bf16, two rounded terms added) is measured against the
same reference: the kernel's mean error must be below it.

Model: SMALL_V4 of tests/gpu/test_deepseek_v4_cuda.py, bf16 with the kernels (the CUDA
default) against float32, prefill logits and teacher-forced decode within that file's TOL
(relative Frobenius 5e-2); the errors with the kernels forced off are printed beside them.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.models.deepseek_v4.hyper_connection import hc_collapse, hc_merge, hc_mix

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.usefixtures("exact_fp32_matmul")  # the fp32 references

U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
T, HC = 4097, 4


def inputs(H: int, dtype: torch.dtype, seed: int):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    h = torch.randn(T, HC, H, device=dev, generator=g).to(dtype)
    out = torch.randn(T, H, device=dev, generator=g).to(dtype)
    post = 2 * torch.rand(T, HC, device=dev, generator=g)
    comb = torch.softmax(torch.randn(T, HC, HC, device=dev, generator=g), -1)
    return h, out, post, comb


def report(name: str, got: torch.Tensor, want: torch.Tensor, S: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    bound = U[dtype] * want.abs() + 2 * (HC + 2) * 2.0 ** -24 * S
    err = (got.float() - want).abs()
    assert got.dtype == dtype and got.shape == want.shape
    assert (err <= bound).all(), f"{name} off by {(err - bound).max().item():.3g} past bound"
    print(f"\n{name} H {want.shape[-1]} {dtype}: max |err| {err.max().item():.3g}, "
          f"max err/bound {(err / bound).max().item():.3f}")
    return err


@cuda
@pytest.mark.parametrize("H, dtype", [(4096, torch.bfloat16), (4000, torch.bfloat16),
                                      (4096, torch.float16)])
def test_merge_matches_fp32_and_beats_the_torch_chain(H, dtype) -> None:
    h, out, post, comb = inputs(H, dtype, seed=H)
    hf, of = h.float(), out.float()
    want = post[..., None] * of[:, None, :] + torch.einsum("tij,tih->tjh", comb, hf)
    S = post[..., None] * of.abs()[:, None, :] + torch.einsum("tij,tih->tjh", comb, hf.abs())
    err = report("merge", hc_merge(h, out, post, comb), want, S, dtype)
    chain = (post.to(dtype)[..., None] * out[:, None, :]
             + torch.matmul(comb.to(dtype).transpose(-1, -2), h))  # the torch branch
    chain_err = (chain.float() - want).abs()
    print(f"mean |err|: kernel {err.mean().item():.3g}, torch chain "
          f"{chain_err.mean().item():.3g}")
    assert err.mean() < chain_err.mean()


@cuda
@pytest.mark.parametrize("H, dtype", [(4096, torch.bfloat16), (4000, torch.bfloat16),
                                      (4096, torch.float16)])
def test_collapse_matches_reference(H, dtype) -> None:
    h, _, pre, _ = inputs(H, dtype, seed=H + 1)
    hf = h.float()
    want = (pre[..., None] * hf).sum(1)
    report("collapse", hc_collapse(h, pre), want, (pre[..., None] * hf.abs()).sum(1), dtype)


@cuda
@pytest.mark.parametrize("H, dtype", [(4096, torch.bfloat16), (4000, torch.float16)])
def test_mix_matches_float64(H, dtype) -> None:
    """hc_mix (3-pass TF32 dots, float32 sums) within 2 (K + 8) 2^-24 S of float64, S = r
    sum_k |h_k| |fn_k|, K = hc H (tests/unit/test_v4_hyper_connection.py), for V4's mix
    (24 outputs) and the head's (4)."""
    h = inputs(H, dtype, seed=H + 2)[0]
    g = torch.Generator(device="cuda").manual_seed(H)
    for N in (24, 4):
        fn = torch.randn(N, HC * H, device="cuda", generator=g) * (HC * H) ** -0.5
        hd, fd = h.double().flatten(1), fn.double()
        r = torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-6)
        want, S = (hd @ fd.T) * r, (hd.abs() @ fd.abs().T) * r
        err = (hc_mix(h, fn, 1e-6).double() - want).abs()
        bound = 2 * (HC * H + 8) * 2.0 ** -24 * S
        assert (err <= bound).all(), (err - bound).max().item()
        print(f"\nmix N {N} H {H} {dtype}: max err/bound {(err / bound).max().item():.3f}")


@cuda
def test_weights_match_the_torch_branch_in_float64() -> None:
    """hc_weights (sigmoids, softmax and 20 Sinkhorn sweeps in one kernel) against the
    model's torch branch run in float64 on the same mix: within 1e-5 relative."""
    from cpmoe.models.deepseek_v4.model import DeepseekV4HyperConnection
    from cpmoe.models.deepseek_v4.config import parse_deepseek_v4
    from tests._v4_tiny import tiny_v4

    hcm = DeepseekV4HyperConnection(parse_deepseek_v4(tiny_v4(HC))).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        hcm.scale.copy_(torch.rand(3, device="cuda", generator=g) + 0.5)
        hcm.base.copy_(torch.randn(hcm.base.shape, device="cuda", generator=g))
    mix = torch.randn(T, (2 + HC) * HC, device="cuda", generator=g) * 3
    got = hcm.weights(mix, torch.empty(0, device="cuda", dtype=torch.bfloat16))
    want = hcm.double().weights(mix.double(), torch.empty(0, device="cuda"))
    for a, b in zip(got, want):
        assert ((a.double() - b).abs() / b.abs()).max().item() <= 1e-5


@cuda
def test_v4_bf16_with_hc_kernels_matches_float32(monkeypatch) -> None:
    from cpmoe.models.deepseek_v4 import model as v4
    from tests.gpu.test_deepseek_v4_cuda import LENGTHS, TOL, _rel, run_both

    calls = []
    kernel = v4.hc_merge

    def counted(*args):
        calls.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(v4, "hc_merge", counted)
    (pre32, dec32), (pre16, dec16) = run_both("cuda")
    assert calls, "the bf16 run did not take the hc kernels"
    errors = [_rel(a, b) for a, b in zip(pre16 + tuple(dec16), pre32 + tuple(dec32))]
    monkeypatch.setattr(v4, "kernel_applies", lambda device, dtype: False)
    _, (off16, offdec16) = run_both("cuda")
    off = [_rel(a, b) for a, b in zip(off16 + tuple(offdec16), pre32 + tuple(dec32))]
    n = len(LENGTHS)
    print(f"\nV4 bf16 vs float32, prefill of {LENGTHS} then decode steps: with the hc kernels "
          f"{[f'{e:.3e}' for e in errors]}; torch branch {[f'{e:.3e}' for e in off]}")
    assert max(errors[:n]) <= TOL and max(errors[n:]) <= TOL, errors
