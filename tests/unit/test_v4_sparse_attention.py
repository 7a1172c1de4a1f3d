"""DeepSeek-V4's sparse sink-attention kernel (cpmoe.models.deepseek_v4.sparse) in Triton's
CPU interpreter against the torch reference `sink_attention` on the gathered keys (a
subprocess: TRITON_INTERPRET is read at import; skipped without Triton), plus its input
checks and the dispatch rule of prefill.

Cases: 4 heads (one padded head block of 16) and 20 (two blocks, the second 4/16 full),
D 64 and 80 (not a power of two), S not a multiple of BLOCK_N, random masks with rows of no
valid key and rows of exactly one, repeated indices within a row, invalid entries pointing
at NaN pool rows (never read), a pool that is a column slice of wider rows, int32 and int64
indices, `out=` a strided view.

Tolerance, float32: the kernel's IEEE fp32 dots and online softmax differ from the
reference's einsum/softmax only in summation order and exp2 vs exp (a few fp32 ulps of the
scores, amplified by |s| <= ~10 here), so |o - ref| <= 2e-5 * attn(|k|) + 1e-6, where
attn(|k|) = sum_n p_n |k_n| (the reference's probabilities on |k|: the scale of the sum).
bf16 (one small case): p and o are each rounded once to bf16, one ulp 2^-7 each (the
interpreter truncates where the GPU rounds), so
|o - ref32| <= 2^-7 * (attn(|k|) + |ref32|) + 2e-5 * attn(|k|) + 1e-6.
Then `prefill_attention`'s kernel branch, forced on for a tiny float32 V4, against its
reference branch.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cpmoe.models.deepseek_v4 import sparse
from tests._interpreter import run_interpreted

_KERNEL = r"""
import torch
from cpmoe.models.deepseek_v4.prefill import sink_attention
from cpmoe.models.deepseek_v4.sparse import sparse_sink_attention

g = torch.Generator().manual_seed(0)


# sum_n p_n |kv_n|: the reference's probabilities (keys kv) applied to |kv|, the scale of
# the errors that rounding p or the scores puts on o
def abs_attention(q, kv, valid, sinks, scale):
    s = torch.einsum("thd,tnd->thn", q.float(), kv) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thn,tnd->thd", p, kv.abs())


def case(T, H, D, S, M, dtype=torch.float32, idx_dtype=torch.int64, sliced=False,
         into_out=False, with_lens=False):
    wide = torch.randn(M, D + 24 if sliced else D, generator=g)
    wide[-3:] = float("nan")  # rows only invalid entries point at
    pool = (wide[:, 5:5 + D] if sliced else wide).to(dtype)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    valid = torch.rand(T, S, generator=g) < 0.6
    valid[0] = False  # no valid key: o = 0
    valid[1] = False
    valid[1, S // 2] = True  # exactly one
    valid[2] = True
    idx = torch.randint(0, M - 3, (T, S), generator=g)
    idx[2, 1::2] = idx[2, 0]  # repeated keys count once each
    idx[~valid] = torch.randint(M - 3, M, (int((~valid).sum()),), generator=g)
    sinks = torch.randn(H, generator=g)
    scale = D ** -0.5
    lens = None
    if with_lens:  # each row's valid keys lie in its first lens[t]; past them, valid junk
        lens = torch.randint(0, S + 1, (T,), generator=g)
        lens[2] = S
        past = torch.arange(S)[None, :] >= lens[:, None]
        idx_bad = torch.randint(M - 3, M, (T, S), generator=g)  # NaN rows: read = caught
        idx = torch.where(past, idx_bad, idx)
        valid_kernel = valid | past  # what the kernel is told: it must stop at lens
        valid = valid & ~past
    out = None
    if into_out:
        out = torch.full((T, H + 3, D), float("nan"), dtype=dtype)[:, 1:H + 1]
    o = sparse_sink_attention(q, pool, idx.to(idx_dtype), valid_kernel if with_lens else valid,
                              sinks, scale, out=out, lens=lens)
    clean = pool.float().nan_to_num(0.0)  # the reference multiplies masked NaNs by 0
    want = sink_attention(q.float(), clean[idx], valid, sinks, scale)
    abs_k = abs_attention(q, clean[idx], valid, sinks, scale)
    bound = 2e-5 * abs_k + 1e-6
    if dtype != torch.float32:
        bound += 2.0 ** -7 * (abs_k + want.abs())
    err = (o.float() - want).abs()
    assert o.dtype == dtype and o.shape == q.shape
    assert (err <= bound).all(), (T, H, D, S, dtype, (err - bound).max().item())
    assert torch.equal(o[0], torch.zeros_like(o[0]))
    if out is not None:
        assert o.data_ptr() == out.data_ptr()
    return err.max().item()


errors = [
    case(7, 4, 64, 45, 50),
    case(6, 20, 64, 77, 120, idx_dtype=torch.int32, into_out=True),
    case(5, 20, 80, 33, 40, sliced=True),
    case(4, 4, 64, 96, 30),  # S a multiple of BLOCK_N, many repeats (M < S)
    case(4, 4, 32, 20, 25, dtype=torch.bfloat16),
    case(9, 4, 64, 150, 60, with_lens=True),  # rows stop early, some before their 1st tile
]
print("sparse sink kernel ok", errors)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_kernel_matches_sink_attention_in_the_interpreter() -> None:
    out = run_interpreted(_KERNEL, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sparse sink kernel ok" in out.stdout

_PREFILL = r"""
import torch
from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4 import prefill
from cpmoe.parallel.groups import ProcessGroups
from tests._v4_tiny import tiny_v4

TINY_V4 = tiny_v4(hc_mult=2)
gen = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (150, 40, 1)]
runner = ModelRunner.from_config(TINY_V4, ProcessGroups.single("cpu"), torch.float32, seed=0)
want = runner.prefill(seqs)
calls = []
kernel = prefill.sparse_sink_attention


def spy(q, pool, idx, valid, sinks, scale, out, lens=None):
    calls.append(idx.shape)
    return kernel(q, pool, idx, valid, sinks, scale, out, lens=lens)


plans = []
build = prefill.PrefillPlan.build


def spy_plan(*args, **kwargs):
    plans.append(build(*args, **kwargs))
    return plans[-1]



prefill.kernel_applies = lambda device, dtype: True  # the CUDA branch, here in float32
prefill.sparse_sink_attention = spy
prefill.PrefillPlan.build = spy_plan
prefill._BLOCK_ELEMS = 1 << 13  # blocks of about 20 rows, some across sequences
got = runner.prefill(seqs)
blocks = plans[0].blocks
assert len(blocks) > 5 and any(s1 - s0 > 1 for _, _, s0, s1 in blocks), blocks
assert len(calls) == 3 * len(blocks), calls  # every layer, every block, through the kernel
assert max(s for _, s in calls) > 32, calls  # CSA rows: window 24 + 16 picks, two tiles
err, top = (got - want).abs().max().item(), want.abs().max().item()
assert err <= 1e-5 * top, (err, top)
print("prefill kernel path ok", err, top)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_prefill_kernel_branch_matches_reference_branch_in_the_interpreter() -> None:
    """A tiny V4 (HCA, CSA and sliding layers; 4 heads) prefilled in float32 through the
    kernel branch of `prefill_attention` (forced on, small blocks across sequences) gives
    the reference branch's logits within 1e-5 of their largest (the kernel matches
    `sink_attention` to fp32 rounding; three layers keep it far below that)."""
    out = run_interpreted(_PREFILL, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prefill kernel path ok" in out.stdout


def test_prefill_runs_the_kernel_only_on_cuda_in_16_bit() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not sparse.kernel_applies(cpu, torch.bfloat16)
    assert not sparse.kernel_applies(cuda, torch.float32)
    assert sparse.kernel_applies(cuda, torch.bfloat16) == (sparse.triton is not None)
    assert sparse.kernel_applies(cuda, torch.float16) == (sparse.triton is not None)


def test_bad_inputs_raise_one_line_errors() -> None:
    q, pool = torch.randn(3, 4, 16), torch.randn(10, 16)
    idx, valid = torch.zeros(3, 5, dtype=torch.int64), torch.ones(3, 5, dtype=torch.bool)
    sinks = torch.zeros(4)
    cases = [
        ((q, pool.half(), idx, valid, sinks), "pool in q's dtype"),
        ((q, torch.randn(10, 8), idx, valid, sinks), r"need q \[T, H, D\] and pool \[M, D\]"),
        ((q, pool, idx[:2], valid[:2], sinks), r"need idx and valid \[T=3, S\]"),
        ((q, pool, idx.float(), valid, sinks), "idx must be int32/int64"),
        ((q, pool, idx, valid.int(), sinks), "valid bool"),
        ((q, pool, idx, valid, torch.zeros(5)), r"sinks \[4\]"),
        ((q, pool.t().contiguous().t(), idx, valid, sinks), "contiguous last axis"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            sparse.sparse_sink_attention(*args, scale=0.25)
        assert "\n" not in str(info.value)


def test_kernel_blocks_are_sized_without_gathered_keys() -> None:
    """At V4's widths (64 heads of 512, window 128 + top-512, 64 indexer heads) a 4096-token
    prompt (1024 CSA entries) fits 13107-row blocks with the kernels (bound by the 640 keys'
    index lists, 8 elements a key, over the indexer's order keys and top-k, 4 an entry) and
    182 without: the gathered keys and scores, not the indexer's dot products, bound the
    torch path's blocks. At 64K tokens (16384 entries) the indexer bounds the kernels'."""
    from cpmoe.models.deepseek_v4.prefill import rows_per_block

    assert rows_per_block(640, 64, 512, 64, 1024, kernel=True) == (1 << 26) // (640 * 8)
    assert rows_per_block(640, 64, 512, 64, 1024, kernel=False) == (1 << 26) // (640 * 576)
    assert rows_per_block(640, 64, 512, 64, 16384, kernel=True) == 1024  # the indexer's bound
    assert rows_per_block(640, 64, 512, 64, 16384, kernel=False) == 64
    assert rows_per_block(640, 64, 512, 64, 0, kernel=True) == (1 << 26) // (640 * 8)
    assert rows_per_block(1 << 30, 64, 512, 64, 0, kernel=False) == 1


def test_benchmark_rows_and_cli_on_cpu() -> None:
    """bench.v4_sparse_attention: CSA rows as prefill builds them (window keys p-W+1..p valid
    where >= 0, then min(topk, entries) distinct picks, valid where the entry is closed at
    p); its arguments parse; without CUDA it exits with one clear line."""
    from bench import v4_sparse_attention as bench

    L, W, K, R = 64, 8, 6, 4
    idx, valid = bench.csa_rows(L, W, K, R, torch.device("cpu"), torch.Generator())
    assert idx.shape == valid.shape == (L, W + K)
    pos = torch.arange(L)
    assert torch.equal(valid[:, :W].sum(1), (pos + 1).clamp(max=W))
    assert torch.equal(idx[:, W - 1], pos)  # the newest window key is the row's own
    picks = idx[:, W:] - L
    assert ((picks >= 0) & (picks < L // R)).all()
    assert torch.equal(valid[:, W:], picks < ((pos + 1) // R)[:, None])
    assert torch.equal(valid[:, W:].sum(1), ((pos + 1) // R).clamp(max=K))
    assert all(len(set(row.tolist())) == K for row in picks)
    a = bench.parse_args(["--lengths", "1024", "--sweep"])
    assert (a.lengths, a.heads, a.dim, a.window, a.topk, a.sweep) == ("1024", 64, 512, 128,
                                                                        512, True)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--lengths", "128"])
