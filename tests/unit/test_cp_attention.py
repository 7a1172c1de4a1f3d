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
        pos, seq = split.local_positions(r), split.local_token_to_seq(r)
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


def _ref_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Varlen flash attention's contract, in fp64 from `_masked_softmax`: sequence i is rows
    cu_q[i]:cu_q[i+1] against keys cu_k[i]:cu_k[i+1], causal aligned bottom-right."""
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert b - a <= max_q and d - c <= max_k
        q_pos = torch.arange(b - a) + (d - c) - (b - a) if causal else torch.full((b - a,), d)
        o[a:b], lse[a:b] = _masked_softmax(q[a:b], q_pos, k[c:d], v[c:d], torch.arange(d - c),
                                           scale)
    return o, lse


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_packed_runs_give_every_run_its_causal_keys(monkeypatch, cp):
    """The CUDA chunk path's one varlen launch (PackedRuns: which keys each run sees, how
    they are packed) against the per-row masked reference, at CP 1 (keys used in place) and
    zigzag CP 2 / 4 (two runs per sequence, keys gathered)."""
    monkeypatch.setattr(att, "varlen_attention", _ref_varlen)
    torch.manual_seed(2)
    lens = [37, 5, 64, 1]
    split = CPSplit.build(lens, cp, "zigzag")
    cu = list(split.cu_seqlens)
    k_flat, v_flat = torch.randn(sum(lens), 2, 16), torch.randn(sum(lens), 2, 16)
    for r in range(cp):
        pos, seq = split.local_positions(r), split.local_token_to_seq(r)
        q = torch.randn(pos.numel(), 8, 16)
        runs = att.query_runs(pos, seq)
        # after a cached prefix always one launch; without one past 16 runs or with a run
        # too short for cuDNN to pay for its plan (as these all are)
        assert att.PackedRuns.wanted(runs, True) and att.PackedRuns.wanted(runs, False)
        assert att.PackedRuns.wanted(runs[:1] * 17, False) and not att.PackedRuns.wanted([], True)
        long = [(0, 4096, 0, 0), (4096, 8192, 1, 0)]
        assert not att.PackedRuns.wanted(long, False) and att.PackedRuns.wanted(long * 9, False)
        assert att.PackedRuns.wanted(long + [(8192, 8192 + 4095, 2, 0)], False)
        packed = att.PackedRuns.build(runs, cu, torch.device("cpu"))
        assert (packed.keys is None) == (cp == 1)
        got, lse = att._varlen_runs(q, k_flat, v_flat, packed, 0.25)
        want = _reference_prefill(q, pos, seq, k_flat, v_flat, cu, 0.25)
        assert (got - want).abs().max() < 1e-5
        _, want_lse = att.chunk_attention_with_lse(q, pos, seq, k_flat, v_flat, cu, 0.25, None)
        assert (lse - want_lse.double()).abs().max() < 1e-5


def test_packed_prefix_leaves_out_empty_shards_and_matches_per_sequence_attention():
    """PackedPrefix over three sequences (one with no slots on this rank, one with no query
    rows): the packed rows/slots and the CPU path of prefix_partial against each sequence's
    rows attending its slots alone; rows of left-out sequences see nothing (lse -inf)."""
    torch.manual_seed(3)
    pool_k, pool_v = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)  # [pages, page, Hkv, D]
    rows = [torch.tensor([0, 1, 2]), torch.tensor([3]), torch.tensor([], dtype=torch.int64)]
    slots = [torch.tensor([4, 5, 6, 9]), torch.tensor([], dtype=torch.int64),
             torch.tensor([1, 2])]
    prefix = att.PackedPrefix.build(rows, slots, torch.device("cpu"))
    assert prefix.counts == [(3, 4)] and prefix.cu_q.tolist() == [0, 3]
    assert prefix.cu_k.tolist() == [0, 4] and prefix.slots.tolist() == [4, 5, 6, 9]
    q = torch.randn(5, 8, 16)
    o, lse = att.prefix_partial(q, prefix, pool_k, pool_v, 0.3)
    k_all, v_all = pool_k.view(-1, 2, 16), pool_v.view(-1, 2, 16)
    want_o, want_lse = _masked_softmax(q[:3], torch.zeros(3), k_all[slots[0]], v_all[slots[0]],
                                       torch.zeros(4), 0.3)
    assert (o[:3].double() - want_o).abs().max() < 1e-5
    assert (lse[:3].double() - want_lse).abs().max() < 1e-5
    assert torch.isinf(lse[3:]).all() and (o[3:] == 0).all()
    none = att.PackedPrefix.build(rows[1:], slots[1:], torch.device("cpu"))
    o, lse = att.prefix_partial(q, none, pool_k, pool_v, 0.3)
    assert none.counts == [] and torch.isinf(lse).all()


def test_packed_prefix_attends_fp8_codes_times_the_layer_scales():
    """FP8 pools with a checkpoint's k_scale / v_scale: the cached prefix is attended as
    codes x scale (against each sequence's masked softmax over those values)."""
    from cpmoe.ops import fill_kv_scale

    torch.manual_seed(5)
    pool_k = torch.randn(6, 4, 2, 16).to(torch.float8_e4m3fn)
    pool_v = torch.randn(6, 4, 2, 16).to(torch.float8_e4m3fn)
    rows, slots = [torch.tensor([0, 1, 2])], [torch.tensor([4, 5, 6, 9])]
    prefix = att.PackedPrefix.build(rows, slots, torch.device("cpu"))
    kv_scale = torch.empty(4)
    fill_kv_scale(kv_scale, 0.6, 3.3)
    q = torch.randn(3, 8, 16)
    o, lse = att.prefix_partial(q, prefix, pool_k, pool_v, 0.3, kv_scale)
    k = pool_k.view(-1, 2, 16)[slots[0]].float() * 0.6
    v = pool_v.view(-1, 2, 16)[slots[0]].float() * 3.3
    want_o, want_lse = _masked_softmax(q, torch.zeros(3), k, v, torch.zeros(4), 0.3)
    assert (o.double() - want_o).abs().max() < 1e-5
    assert (lse.double() - want_lse).abs().max() < 1e-5


def test_packed_prefix_over_every_row_in_order_attends_in_place():
    """Every query row, in order (each sequence of a CP-1 step has a prefix): in_order, and
    prefix_partial gives what it gives when the rows are gathered and scattered back."""
    torch.manual_seed(4)
    pool_k, pool_v = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    rows = [torch.tensor([0, 1, 2]), torch.tensor([3, 4])]
    slots = [torch.tensor([4, 5, 6, 9]), torch.tensor([1, 2])]
    q = torch.randn(5, 8, 16)
    prefix = att.PackedPrefix.build(rows, slots, torch.device("cpu"))
    assert prefix.in_order
    o, lse = att.prefix_partial(q, prefix, pool_k, pool_v, 0.3)
    shuffled = att.PackedPrefix.build(rows[::-1], slots[::-1], torch.device("cpu"))
    assert not shuffled.in_order
    want_o, want_lse = att.prefix_partial(q, shuffled, pool_k, pool_v, 0.3)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    fewer = att.PackedPrefix.build(rows, slots, torch.device("cpu"))  # rows 0..4 of 6
    o6, lse6 = att.prefix_partial(torch.cat([q, q[:1]]), fewer, pool_k, pool_v, 0.3)
    assert torch.equal(o6[:5], o) and torch.isinf(lse6[5]).all() and (o6[5] == 0).all()
