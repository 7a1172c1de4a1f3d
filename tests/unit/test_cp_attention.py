"""CP attention math: run decomposition (the CUDA path's structure), LSE merge, partials.

The reference is `_masked_softmax`: per query and head, a float64 softmax over the keys whose
positions it may see, written here with loops and no code of cpmoe.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe import ops
from cpmoe.cp import attention as att
from cpmoe.cp.split import CPSplit


def _ref_attention_with_lse(q, k, v, causal, scale):
    """Plain fp64 attention returning lse, standing in for the CUDA kernels on CPU."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1 + m - n), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ v.double()).to(q.dtype), lse.float()


def _masked_softmax(q, q_pos, k, v, k_pos, scale):
    """q [T, H, D], k/v [N, Hkv, D] -> (o [T, H, D], lse [T, H]) in float64; query head h
    reads KV head h // (H / Hkv); a query that sees no key gets o = 0, lse = -inf."""
    T, H, D = q.shape
    group = H // k.shape[1]
    o = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        visible = [n for n in range(k.shape[0]) if int(k_pos[n]) <= int(q_pos[t])]
        if not visible:
            continue
        for h in range(H):
            keys, values = k[visible, h // group].double(), v[visible, h // group].double()
            scores = (keys @ q[t, h].double()) * scale
            weights = torch.exp(scores - scores.max())
            lse[t, h] = scores.max() + torch.log(weights.sum())
            o[t, h] = (weights / weights.sum()) @ values
    return o, lse


def _reference_prefill(q, pos, seq, k_flat, v_flat, cu, scale):
    """Each query row against the keys of its own sequence, causal on positions."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        s = int(seq[t])
        k, v = k_flat[cu[s]:cu[s + 1]], v_flat[cu[s]:cu[s + 1]]
        out[t] = _masked_softmax(q[t:t + 1], pos[t:t + 1], k, v, torch.arange(k.shape[0]),
                                 scale)[0][0]
    return out


def test_masked_softmax_reference_is_plain_attention():
    """The reference itself, on a case small enough to write out: one query at position 1
    sees keys 0 and 1 with scores 0 and log 3 -> weights 1/4, 3/4."""
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[0.0, 5.0]], [[float(torch.log(torch.tensor(3.0))), 0.0]],
                      [[100.0, 0.0]]])
    v = torch.tensor([[[4.0, 0.0]], [[0.0, 8.0]], [[1e6, 1e6]]])
    o, lse = _masked_softmax(q, torch.tensor([1]), k, v, torch.tensor([0, 1, 2]), 1.0)
    assert torch.allclose(o, torch.tensor([[[1.0, 6.0]]], dtype=torch.float64))
    assert torch.allclose(lse, torch.log(torch.tensor([[4.0]], dtype=torch.float64)))


@pytest.mark.parametrize("cp, strategy", [(1, "zigzag"), (2, "zigzag"), (4, "zigzag")])
def test_run_decomposition_matches_masked_attention(monkeypatch, cp, strategy):
    monkeypatch.setattr(att, "attention_with_lse", _ref_attention_with_lse)
    torch.manual_seed(0)
    lens = [37, 5, 64]
    split = CPSplit.build(lens, cp, strategy)
    k_flat, v_flat = torch.randn(sum(lens), 2, 16), torch.randn(sum(lens), 2, 16)
    for r in range(cp):
        pos, seq = split.local_positions(r), split.local_seq_ids(r)
        q = torch.randn(pos.numel(), 8, 16)
        runs = att.query_runs(pos, seq)
        assert len(runs) <= 2 * len(lens)
        cu = list(split.cu_seqlens)
        want = _reference_prefill(q, pos, seq, k_flat, v_flat, cu, 0.25)
        got = att._prefill_runs_cuda(q, k_flat, v_flat, cu, 0.25, runs)
        assert (got.double() - want).abs().max() < 1e-5
        masked = att.prefill_attention(q, pos, seq, k_flat, v_flat, cu, 0.25)  # CPU path
        assert (masked.double() - want).abs().max() < 1e-5


def test_merge_of_shards_equals_full_attention_and_empty_shard_weighs_zero():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    q_pos, k_pos = torch.tensor([19, 10, 0]), torch.arange(20)
    want_o, want_lse = _masked_softmax(q, q_pos, k, v, k_pos, 0.3)
    full_o, full_lse = att.partial_attention(q, q_pos, k, v, k_pos, 0.3)
    assert (full_o.double() - want_o).abs().max() < 1e-5
    assert (full_lse.double() - want_lse).abs().max() < 1e-5
    shards = [torch.arange(0, 20, 3), torch.arange(1, 20, 3), torch.arange(2, 20, 3),
              torch.tensor([], dtype=torch.int64)]
    parts = [att.partial_attention(q, q_pos, k[i], v[i], k_pos[i], 0.3) for i in shards]
    for i, (o, lse) in zip(shards, parts):  # each shard alone, the query at 0 sees nothing
        ref_o, ref_lse = _masked_softmax(q, q_pos, k[i], v[i], k_pos[i], 0.3)
        assert (o.double() - ref_o).abs().max() < 1e-5
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse.double()[finite], ref_lse[finite], rtol=0, atol=1e-5)
    assert torch.isinf(parts[1][1][2]).all() and torch.isinf(parts[3][1]).all()
    merged = ops.merge_partials(torch.stack([p[0] for p in parts]),
                                torch.stack([p[1] for p in parts]))
    assert (merged.double() - want_o).abs().max() < 1e-5
    assert torch.isfinite(merged).all()
