"""DeepSeek-V4's lightning-indexer score kernel (cpmoe.models.deepseek_v4.indexer) in Triton's
CPU interpreter against a float64 evaluation of its formula (a subprocess: TRITON_INTERPRET
is read at import; skipped without Triton), plus its input checks and `select_visible`
through the kernel branch against the reference branch.

Cases: 6 heads, D 32, 64 and 48 (not a power of two: a padded, masked tile), T and C not
multiples of the tiles with several tiles each way (the defaults 64 x 128 and 16 x 16),
random signs so about half of the dot products are negative (relu matters: the test checks
that dropping it would fail), a head whose weight is 0 for every row and a row whose weights
are all 0 (its scores exactly 0), per-row bounds of the visible entries (-inf exactly
outside; a row that sees all, one that sees none), strided q and w, and one bf16 case. With
bounds also the order keys (they decode to the scores and entries) and `indexer_topk`
against a stable descending sort of the same scores (equal, ties included).

Tolerance, elementwise, from fp32 rounding (u = 2^-24): the kernel's IEEE fp32 dot of D
products is off by at most D u sum_i |q_i k_i| = D u A[t, h, c]; relu moves no error up;
summing h weighted heads in fp32 and the final scale add at most (h + 2) u scale
sum_h |w| relu <= (h + 2) u S with S[t, c] = scale sum_h |w[t, h]| A[t, h, c]; the float64
reference rounded to fp32 adds u |ref| <= u S. So |kernel - ref| <= (D + h + 3) u S. bf16
inputs: the products of 16-bit values are exact in fp32, the same bound against the float64
formula on the bf16 values. A wrong head, weight, key or tile edge moves scores by a fair
share of S, thousands of times the bound.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.models.deepseek_v4 import indexer
from tests._interpreter import run_interpreted

_KERNEL = r"""
import torch
from cpmoe.models.deepseek_v4.indexer import indexer_scores, indexer_topk

g = torch.Generator().manual_seed(0)


def reference(q, keys, w, scale, relu=True):
    dots = torch.einsum("thd,cd->thc", q.double(), keys.double())
    dots = dots.clamp(min=0) if relu else dots
    return scale * (w.double()[..., None] * dots).sum(1)


def case(T, H, D, C, dtype=torch.float32, masked=False, **tiles):
    q = torch.randn(T, H + 2, D, generator=g)[:, 1:H + 1].to(dtype)  # strided heads
    keys = torch.randn(C, D, generator=g).to(dtype)
    w = torch.randn(H, T, generator=g).T  # strided rows
    w[:, 2] = 0.0  # a head that counts for nobody
    w[3] = 0.0  # a row whose scores are all 0
    scale = D ** -0.5
    visible = bounds = None
    if masked:  # row t sees [lo, hi): some rows nothing, some everything
        lo = torch.randint(0, C, (T,), generator=g)
        hi = (lo + torch.randint(0, C, (T,), generator=g)).clamp(max=C)
        lo[0], hi[0], lo[1], hi[1] = 0, C, 5, 5
        c = torch.arange(C)
        visible = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
        bounds = (lo, hi)
    got = indexer_scores(q, keys, w, scale, bounds, **tiles)
    want = reference(q, keys, w, scale)
    abs_sum = scale * (w.double().abs()[..., None]
                       * torch.einsum("thd,cd->thc", q.double().abs(), keys.double().abs())
                       ).sum(1)
    bound = (D + H + 3) * 2.0 ** -24 * abs_sum
    assert got.dtype == torch.float32 and got.shape == (T, C)
    if visible is not None:
        assert torch.equal(got == float("-inf"), ~visible)
        got, want, bound = (torch.where(visible, x, 0) for x in (got, want, bound))
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (T, H, D, C, dtype, (err - bound).max().item())
    assert (got[3] == 0).all()
    without_relu = (reference(q, keys, w, scale, relu=False) - want).abs()
    if visible is not None:
        without_relu = torch.where(visible, without_relu, 0)
    assert without_relu.max() > 1000 * bound.max()  # the check above would catch no relu
    if bounds is not None:
        check_topk(q, keys, w, scale, bounds, visible, tiles)
    return err.max().item(), bound.max().item()


# The order keys decode to the scores' bits and entries, and `indexer_topk` picks what a
# stable descending sort of the same scores picks: row 3's scores all tie at 0 (its weights
# are 0), so ties go to the lower entry; -1 where not visible.
def check_topk(q, keys, w, scale, bounds, visible, tiles):
    scores = indexer_scores(q, keys, w, scale, bounds, **tiles)
    order = indexer_scores(q, keys, w, scale, bounds, order_keys=True, **tiles)
    high, low = order >> 32, order & 0xFFFFFFFF
    bits = torch.where(high >= 0, high, high ^ 0x7FFFFFFF).to(torch.int32)
    assert torch.equal(bits.view(torch.float32), scores)
    assert torch.equal(low, 0xFFFFFFFF - torch.arange(scores.shape[1]).expand_as(low))
    for k in (1, 7, scores.shape[1]):
        picks = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        want = torch.where(visible.gather(1, picks), picks, -1)
        got = indexer_topk(q, keys, w, scale, bounds, k)
        assert torch.equal(got, want), (k, (got != want).nonzero()[:5])


results = [
    case(70, 6, 64, 130),  # defaults: 2 x 2 tiles, both partial
    case(37, 6, 32, 45, masked=True, block_t=16, block_c=16),  # 3 x 3 tiles
    case(20, 6, 48, 50, masked=True, block_t=16, block_c=32),  # D padded to 64
    case(33, 6, 32, 40, dtype=torch.bfloat16, block_t=16, block_c=16),
]
print("indexer kernel ok", results)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_kernel_matches_float64_formula_in_the_interpreter() -> None:
    out = run_interpreted(_KERNEL, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "indexer kernel ok" in out.stdout


_SELECT = r"""
import torch
from cpmoe.models.deepseek_v4 import attention
from cpmoe.models.deepseek_v4.config import parse_deepseek_v4

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 128, "hidden_size": 64, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
    "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "sliding_window": 24, "index_n_heads": 6, "index_head_dim": 32, "index_topk": 8,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "hc_mult": 2,
    "compress_ratios": [4, 0], "num_hash_layers": 1, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
}
g = torch.Generator().manual_seed(1)
idx = attention.DeepseekV4Indexer(parse_deepseek_v4(CONFIG), torch.float32)
for p in idx.parameters():
    p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
T, E = 40, 150
q_res, x = torch.randn(T, 32, generator=g), torch.randn(T, 64, generator=g)
angles = torch.rand(T, 8, generator=g) * 6.3
keys = torch.randn(E, 32, generator=g)
lo = torch.randint(0, E, (T,), generator=g)
hi = (lo + torch.randint(0, E, (T,), generator=g)).clamp(max=E)
lo[5], hi[5] = 7, 7  # no visible entry: every pick -1
lo[6], hi[6] = 0, 3  # fewer visible entries than top-k
c = torch.arange(E)
visible = (c[None, :] >= lo[:, None]) & (c[None, :] < hi[:, None])
args = (q_res, x, angles.cos(), angles.sin(), keys, lo, hi, E - lo, torch.arange(T))
calls = []
kernel = attention.indexer_topk


def spy(*a):
    calls.append(a[0].shape)
    return kernel(*a)


attention.indexer_topk = spy
attention.kernel_applies = lambda device, dtype: False
want = idx.select_visible(*args)
q = attention.apply_interleaved_rope(idx.q_b_proj(q_res).view(T, 6, 32), angles.cos(),
                                     angles.sin())
scores = idx.scorer(q, keys, x, visible)
attention.kernel_applies = lambda device, dtype: True  # the CUDA branch, here in float32
got = idx.select_visible(*args)
assert calls == [(T, 6, 32)], calls  # the kernel branch ran, once

# The branches break exact ties their own ways (the kernel: to the lower entry; float32: as
# the reference's torch.topk), so the same SET of picks is due where the 8th and 9th best
# visible scores are apart by far more than the kernel's fp32 error (~1e-6 of their scale):
# most rows, rows with tied zeros inside their top 8 among them
top = scores.sort(dim=-1, descending=True).values[:, :9]
gap = (top[:, 7] - top[:, 8]).nan_to_num(float("inf"), float("inf"))
apart = gap > 1e-4 * scores[visible].abs().max()
inner_ties = ((top[:, :7] == 0) & (top[:, 1:8] == 0)).any(dim=1) & apart
assert apart.sum() >= 20 and inner_ties.any() and apart[5] and apart[6], (apart, inner_ties)
assert torch.equal(got[apart].sort(dim=1).values, want[apart].sort(dim=1).values), (
    (got.sort(dim=1).values != want.sort(dim=1).values).nonzero()[:5])
assert (got[5] == -1).all() and (got[6, 3:] == -1).all()
assert sorted(got[6, :3].tolist()) == [0, 1, 2]
print("select_visible kernel branch ok", int(apart.sum()), int(inner_ties.sum()))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_select_visible_kernel_branch_matches_reference_branch_in_the_interpreter() -> None:
    """`select_visible` of a float32 indexer (6 heads of 32, top-8 of 150 entries, random
    visibility; a row that sees nothing, one that sees fewer than top-k) with the kernel
    branch forced on picks the set the float32 branch picks, on every row whose 8th and 9th
    visible scores are apart by far more than the kernel's fp32 error (at least 20 of the 40
    rows, some with exact ties inside their top 8, checked; the branches break exact ties
    differently, and near ties may legitimately flip)."""
    out = run_interpreted(_SELECT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "select_visible kernel branch ok" in out.stdout


def test_bad_inputs_raise_one_line_errors() -> None:
    q, keys, w = torch.randn(3, 4, 16), torch.randn(10, 16), torch.randn(3, 4)
    lo, hi = torch.zeros(3, dtype=torch.int64), torch.full((3,), 10)
    cases = [
        ((q, keys[:, :8], w, 0.25), r"need q \[T, h, D\] and keys \[C, D\]"),
        ((q, keys.half(), w, 0.25), "keys in q's dtype"),
        ((q, keys, w.double(), 0.25), r"need w float32 \(3, 4\)"),
        ((q, keys, w[:2], 0.25), r"need w float32 \(3, 4\)"),
        ((q, keys, w, 0.25, (lo, hi.int())), r"need bounds \(lo, hi\) int64 \[3\]"),
        ((q, keys, w, 0.25, (lo[:2], hi)), r"need bounds \(lo, hi\) int64 \[3\]"),
        ((q, keys.t().contiguous().t(), w, 0.25), "contiguous last axis"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            indexer.indexer_scores(*args)
        assert "\n" not in str(info.value)


def test_benchmark_reference_is_the_scorers_torch_branch_and_cli_on_cpu() -> None:
    """bench.v4_indexer times what the scorer runs without the kernel: its `torch_scores` on
    bf16 inputs equals `DeepseekV4IndexerScorer` (on CPU: the torch branch) bit for bit; its
    causal mask opens entry c at position 4c + 3; its arguments parse; without CUDA it exits
    with one clear line."""
    from bench import v4_indexer as bench
    from cpmoe.models.deepseek_v4.attention import DeepseekV4IndexerScorer

    g = torch.Generator().manual_seed(0)
    scorer = DeepseekV4IndexerScorer(24, 6, 32, torch.bfloat16)
    scorer.weights_proj.weight.copy_(torch.randn(6, 24, generator=g))
    q = torch.randn(9, 6, 32, generator=g).bfloat16()
    keys, x = torch.randn(11, 32, generator=g).bfloat16(), torch.randn(9, 24).bfloat16()
    visible = torch.rand(9, 11, generator=g) < 0.6
    w = scorer.weights_proj(x).float() * 6 ** -0.5
    want = scorer(q, keys, x, visible)
    assert torch.equal(bench.torch_scores(q, keys, w, 32 ** -0.5, visible), want)
    assert (want == float("-inf")).sum() == (~visible).sum()
    seen = bench.causal_visible(40, 4, torch.device("cpu"))
    assert seen.shape == (40, 10)
    assert torch.equal(seen.sum(1), (torch.arange(40) + 1) // 4)
    assert not seen[2, 0] and seen[3, 0] and not seen[38, 9] and seen[39, 9]
    a = bench.parse_args(["--lengths", "1024", "--sweep"])
    assert (a.lengths, a.heads, a.dim, a.rate, a.sweep) == ("1024", 64, 128, 4, True)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--lengths", "128"])


def test_topk_as_reference_takes_each_row_as_topk_of_that_row_alone() -> None:
    """Rows of many lengths in one call, each picking what `torch.topk` of its own row alone
    picks (the reference calls it on one query's row of its sequence's entries): rows full
    of exact ties (zeros), -inf where not visible, columns past the scores (the row's
    entries past the last visible one) counted as -inf, rows of length 0 and below k."""
    g = torch.Generator().manual_seed(3)
    T, C, k = 60, 90, 8
    scores = torch.randn(T, C, generator=g).clamp(max=0.0)  # half the entries tie at 0
    scores[torch.rand(T, C, generator=g) < 0.2] = float("-inf")
    first = torch.randint(0, 40, (T,), generator=g)
    length = torch.randint(0, 80, (T,), generator=g)  # some rows run past column C
    length[0], length[1] = 0, 5
    got = indexer.topk_as_reference(scores, first, length, k)
    assert got.shape == (T, k)
    padded = torch.cat([scores, torch.full((T, 200), float("-inf"))], dim=1)
    mismatched_elsewhere = 0
    for t in range(T):
        n = int(length[t])
        row = padded[t, first[t]:first[t] + n]
        want = torch.full((k,), -1)
        if n:
            best = row.topk(min(k, n))
            picks = torch.where(best.values > float("-inf"), best.indices + first[t], -1)
            want[:picks.numel()] = picks
            # what a longer row would pick: ties make the length matter (not always)
            longer = padded[t, first[t]:first[t] + n + 50].topk(min(k, n)).indices
            mismatched_elsewhere += int(not torch.equal(longer + first[t], best.indices
                                                        + first[t]))
        assert torch.equal(got[t], want), (t, got[t], want)
    assert (got[0] == -1).all() and (got[1, 5:] == -1).all()
    assert mismatched_elsewhere > 0  # the rows' own lengths are what made these picks
