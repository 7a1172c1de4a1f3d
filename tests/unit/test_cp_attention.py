"""CP attention math: run decomposition (the CUDA path's structure), LSE merge, partials."""

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
        want = att.prefill_attention(q, pos, seq, k_flat, v_flat, cu, 0.25)
        got = att._prefill_runs_cuda(q, k_flat, v_flat, cu, 0.25, runs)
        assert (got - want).abs().max() < 1e-5


def test_merge_of_shards_equals_full_attention_and_empty_shard_weighs_zero():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    q_pos, k_pos = torch.tensor([19, 10, 0]), torch.arange(20)
    full, _ = att.partial_attention(q, q_pos, k, v, k_pos, 0.3)
    shards = [torch.arange(0, 20, 3), torch.arange(1, 20, 3), torch.arange(2, 20, 3),
              torch.tensor([], dtype=torch.int64)]
    parts = [att.partial_attention(q, q_pos, k[i], v[i], k_pos[i], 0.3) for i in shards]
    merged = ops.merge_partials(torch.stack([p[0] for p in parts]),
                                torch.stack([p[1] for p in parts]))
    assert (merged - full).abs().max() < 1e-6
    assert torch.isfinite(merged).all()
