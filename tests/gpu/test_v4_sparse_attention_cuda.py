"""DeepSeek-V4's sparse sink-attention kernel (cpmoe.models.deepseek_v4.sparse) on CUDA in
16 bits against the float32 torch reference `sink_attention` on the same values, gathered.
Skipped without a GPU; on the GPU machine:
`python3 -m pytest tests/gpu/test_v4_sparse_attention_cuda.py -q`.

Shape: V4's (64 heads of 512; 20 heads for a partial head block), the keys a CSA layer
gives rows of a 2400-token prompt (window 128 + up to 512 picks, S = 640;
`bench.v4_sparse_attention.csa_rows`), 400 rows from position 0 (one valid key) to the end,
one row with no valid key, invalid entries pointing at NaN pool rows.

Tolerance, elementwise, from the 16-bit rounding (u = 2^-8 for bf16, 2^-11 for fp16, round to
nearest): the q.k products of 16-bit values are exact in fp32 and accumulate in fp32, so a
score is off by at most delta = D * 2^-24 * scale * max|q| * max|k| (fp32 summation of D
terms), which moves each probability by a factor within exp(+-2 delta): |do| <= 2 delta *
attn(|k|). Two roundings reach o: each probability is rounded to 16 bits for the P.V
tensor-core product (<= u * attn(|k|) = u * sum_n p_n |k_n|) and o is rounded once
(<= u * |o|). So |o - ref| <= u * (attn(|k|) + |ref|) + (2 delta + 1e-5) * attn(|k|) + 1e-6,
the 1e-5 for exp2 approximations and fp32 sums. delta is about 1.4e-3 here (a worst case of
aligned vectors); a wrong mask, index or sink gives errors of order |o| ~ 0.1-1.
"""

from __future__ import annotations

import pytest
import torch

from bench.v4_sparse_attention import csa_rows
from cpmoe.models.deepseek_v4.prefill import sink_attention
from cpmoe.models.deepseek_v4.sparse import sparse_sink_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

L, W, TOPK, RATE, D, NAN_ROWS = 2400, 128, 512, 4, 512, 4
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


# the fp32 reference must not run in TF32 (tests/gpu/conftest.py)
pytestmark = pytest.mark.usefixtures("exact_fp32_matmul")


def abs_attention(q, kv, valid, sinks, scale):
    """sum_n p_n |kv_n|: the reference's probabilities (keys kv) applied to |kv|, the scale
    of the errors that rounding p or the scores puts on o."""
    s = torch.einsum("thd,tnd->thn", q.float(), kv) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thn,tnd->thd", p, kv.abs())


def v4_case(heads: int, dtype: torch.dtype, seed: int):
    """-> (q, pool, idx, valid, sinks): 400 rows of a CSA layer of an L-token prompt."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    idx, valid = csa_rows(L, W, TOPK, RATE, dev, gen)
    rows = torch.cat([torch.arange(0, L, 6, device=dev), torch.tensor([L - 1], device=dev)])
    idx, valid = idx[rows], valid[rows]
    valid[1] = False  # a row with no valid key: o = 0
    M = L + L // RATE
    idx[~valid] = M + torch.randint(0, NAN_ROWS, (int((~valid).sum()),), device=dev,
                                    generator=gen)
    pool = torch.randn(M + NAN_ROWS, D, device=dev, generator=gen).to(dtype)
    pool[M:] = float("nan")  # never read: only invalid entries point here
    q = torch.randn(rows.numel(), heads, D, device=dev, generator=gen).to(dtype)
    sinks = torch.randn(heads, device=dev, generator=gen)
    return q, pool, idx, valid, sinks


@cuda
@pytest.mark.parametrize("heads, dtype, idx_dtype", [
    (64, torch.bfloat16, torch.int64), (20, torch.bfloat16, torch.int32),
    (64, torch.float16, torch.int64)])
def test_kernel_matches_fp32_reference_at_v4_shape(heads, dtype, idx_dtype) -> None:
    q, pool, idx, valid, sinks = v4_case(heads, dtype, seed=heads)
    scale = D ** -0.5
    o = sparse_sink_attention(q, pool, idx.to(idx_dtype), valid, sinks, scale)
    clean = pool.float().nan_to_num(0.0)  # the reference multiplies masked NaNs by 0
    want = sink_attention(q.float(), clean[idx], valid, sinks, scale)
    abs_k = abs_attention(q, clean[idx], valid, sinks, scale)
    delta = D * 2.0 ** -24 * scale * (q.float().norm(dim=-1).max()
                                      * clean.norm(dim=-1).max()).item()
    bound = U[dtype] * (abs_k + want.abs()) + (2 * delta + 1e-5) * abs_k + 1e-6
    err = (o.float() - want).abs()
    assert o.dtype == dtype and o.shape == q.shape
    assert (err <= bound).all(), f"o off by {(err - bound).max().item():.3g} past the bound"
    assert not o[1].any()
    print(f"\nheads {heads} {dtype}: max |o - ref| {err.max().item():.3g}, "
          f"max err/bound {(err / bound).max().item():.3f}, delta {delta:.3g}")
