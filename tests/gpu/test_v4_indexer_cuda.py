"""DeepSeek-V4's lightning-indexer score kernel (cpmoe.models.deepseek_v4.indexer) on CUDA in
16 bits against the fp32 torch path it replaces (`bench.v4_indexer.torch_scores`, the
scorer's torch branch) on the same values. Skipped without a GPU; on the GPU machine:
`python3 -m pytest tests/gpu/test_v4_indexer_cuda.py -q`.

Shape: V4's index heads (64 of 128), T = 500 rows of a 8000-token prompt (positions spread
over it, so every row sees a different prefix of the entries) against its C = 2000 CSA
entries: neither a multiple of the 64 x 128 tiles. Weights of scale 64^-0.5 with one head
zero for every row and one row all zero (scores exactly 0).

Tolerance, elementwise. Both paths read the same 16-bit values, so their rounding is not an
error; the products of two bf16 (8-bit) or fp16 (11-bit) significands are exact in fp32.
With A[t, h, c] = sum_i |q_thi k_ci| and S[t, c] = scale sum_h |w_th| A[t, h, c]:
- the kernel's tensor-core dot accumulates D exact products in fp32; allowing one ulp
  (2^-23, not half of one: tensor cores may truncate while aligning) per addition, it is off
  by <= D 2^-23 A; the reference's fp32 GEMM (no TF32) by <= D 2^-24 A;
- relu moves no error up; each path sums h weighted, scaled heads in fp32: <= (h + 2) 2^-24
  sum_h |w| relu <= (h + 2) 2^-24 S each.
So |kernel - reference| <= (3 D + 2 h + 4) 2^-24 S, about 3e-5 S at D 128, h 64. The
scores' own size is a few percent of S (random signs), so a dropped head, a wrong weight or a
tile edge off by one moves them by far more than the bound.
"""

from __future__ import annotations

import pytest
import torch

from bench.v4_indexer import torch_scores
from cpmoe.models.deepseek_v4.indexer import indexer_scores, indexer_topk

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

T, C, H, D, L, RATE = 500, 2000, 64, 128, 8000, 4


# the fp32 reference must not run in TF32 (tests/gpu/conftest.py)
pytestmark = pytest.mark.usefixtures("exact_fp32_matmul")


def score_bound(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                scale: float) -> torch.Tensor:
    """(3 D + 2 h + 4) 2^-24 S [T, C], S = scale sum_h |w| (|q| . |k|): the bound on
    |kernel - torch path| derived in the module docstring."""
    (_, h, d), abs_k = q.shape, keys.float().abs()
    abs_dots = torch.matmul(q.float().abs(), abs_k.T)  # [T, h, C]
    S = scale * (w.abs()[..., None] * abs_dots).sum(dim=1)
    return (3 * d + 2 * h + 4) * 2.0 ** -24 * S


def case(dtype: torch.dtype, seed: int):
    """-> (q, keys, w, bounds, visible): T rows at positions spread over an L-token prompt,
    row t seeing entries [0, (pos + 1) // RATE)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(T, H, D, device=dev, generator=gen).to(dtype)
    keys = torch.randn(C, D, device=dev, generator=gen).to(dtype)
    w = torch.randn(T, H, device=dev, generator=gen) * H ** -0.5
    w[:, 5] = 0.0
    w[7] = 0.0
    pos = torch.linspace(0, L - 1, T, device=dev).long()
    hi = (pos + 1) // RATE
    visible = torch.arange(C, device=dev)[None, :] < hi[:, None]
    return q, keys, w, (torch.zeros_like(hi), hi), visible


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_fp32_torch_path_at_v4_shape(dtype) -> None:
    q, keys, w, bounds, visible = case(dtype, seed=0)
    scale = D ** -0.5
    got = indexer_scores(q, keys, w, scale, bounds)
    want = torch_scores(q, keys, w, scale, visible)
    bound = score_bound(q, keys, w, scale)
    assert got.dtype == torch.float32 and got.shape == (T, C)
    assert torch.equal(got == float("-inf"), ~visible)
    err = torch.where(visible, got - want, 0).abs()
    assert (err <= bound).all(), f"scores off by {(err - bound).max().item():.3g} past the bound"
    assert (got[7][visible[7]] == 0).all()
    no_mask = indexer_scores(q, keys, w, scale)  # every score, no -inf
    assert torch.equal(torch.where(visible, no_mask, float("-inf")), got)
    print(f"\n{dtype}: max |kernel - fp32| {err.max().item():.3g}, max err/bound "
          f"{(err / bound.clamp(min=1e-30)).max().item():.3g}, max |score| "
          f"{torch.where(visible, want, 0).abs().max().item():.3g}")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_picks_what_a_stable_sort_of_the_scores_picks(dtype) -> None:
    """`indexer_topk` on the GPU (the kernel's int64 order keys, torch.topk) equals a stable
    descending sort of the kernel's own scores, -1 where not visible: the same picks in the
    same order, row 7's all-zero ties going to the lower entries."""
    q, keys, w, bounds, visible = case(dtype, seed=1)
    scale = D ** -0.5
    scores = indexer_scores(q, keys, w, scale, bounds)
    for k in (512, C):
        picks = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        want = torch.where(visible.gather(1, picks), picks, -1)
        got = indexer_topk(q, keys, w, scale, bounds, k)
        assert torch.equal(got, want), (k, (got != want).nonzero()[:5])


@cuda
@pytest.mark.parametrize("entries", [2000, 16384])
def test_topk_temporaries_fit_the_prefill_plans_count(entries) -> None:
    """`indexer_topk`'s C-sized temporaries (the kernel's int64 order keys, then
    torch.topk's) peak within what `rows_per_block` counts for them: _KERNEL_INDEX_ELEMS
    fp32-sized elements an entry of a row."""
    from cpmoe.models.deepseek_v4 import prefill

    rows, dev = 200, torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(rows, H, D, device=dev, generator=gen).to(torch.bfloat16)
    keys = torch.randn(entries, D, device=dev, generator=gen).to(torch.bfloat16)
    w = torch.randn(rows, H, device=dev, generator=gen) * H ** -0.5
    hi = torch.randint(0, entries + 1, (rows,), device=dev, generator=gen)
    torch.cuda.synchronize()
    # the bytes asked for, not the blocks handed out: a cached block up to 1 MiB larger than
    # the request is not split, so "allocated" depends on what earlier tests left cached
    # (at 2000 entries: 3.60 in full runs of tests/gpu, 4.20 in one without test_fp8_cuda)
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    picks = indexer_topk(q, keys, w, D ** -0.5, (torch.zeros_like(hi), hi), 512)
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
    per_entry = (peak - base) / (4 * rows * entries)
    print(f"\n{entries} entries: {per_entry:.2f} fp32-sized elements an entry of a row "
          f"(counted: {prefill._KERNEL_INDEX_ELEMS})")
    assert picks.shape == (rows, 512)
    assert per_entry <= prefill._KERNEL_INDEX_ELEMS, per_entry
