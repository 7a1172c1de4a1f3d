"""CUDA kernels against the CPU reference paths (skipped without a GPU; run on the GPU machine:
`python3 -m pytest tests/gpu -q`)."""

from __future__ import annotations

import pytest
import torch

from cpmoe.cp import attention as att
from cpmoe.cp.split import CPSplit
from cpmoe.moe.experts import LocalExperts

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2)])
def test_grouped_experts_match_loop(dtype, tol):
    torch.manual_seed(0)
    m = LocalExperts(16, 256, 128, dtype).cuda()
    torch.nn.init.normal_(m.gate_up_proj, std=0.05)
    torch.nn.init.normal_(m.down_proj, std=0.05)
    x = torch.randn(3000, 256, device="cuda", dtype=dtype)
    ids = torch.randint(-1, 16, (3000, 8), device="cuda")
    w = torch.rand(3000, 8, device="cuda", dtype=dtype)
    want = m._forward_loop(x.float(), ids, w.float()) if dtype == torch.float32 else \
        m.float()._forward_loop(x.float(), ids, w.float())
    m = m.to(dtype)
    got = m._forward_grouped(x, ids, w).float()
    rel = (got - want).norm() / want.norm()
    assert rel < tol, rel


@cuda
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_decode_experts_match_loop_in_bf16(rows):
    """The decode experts (moe/fused_moe.py) in bf16 against the loop in float32 at
    Qwen3-30B-A3B's expert widths (the compact grid of batch 1 included). The bound is
    bf16's: inputs, weights and the gated output each rounded to 8 mantissa bits (2^-9
    relative), compounding to well under 1e-2 over these sums; a wrong slot, expert or
    weight is of order 1."""
    from cpmoe.moe import fused_moe
    torch.manual_seed(2)
    E, H, inter, K = 64, 2048, 768, 8
    m = LocalExperts(E, H, inter, torch.float32).cuda()
    torch.nn.init.normal_(m.gate_up_proj, std=0.03)
    torch.nn.init.normal_(m.down_proj, std=0.03)
    x = torch.randn(rows, H, device="cuda")
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(rows)])
    ids[0, 0] = -1  # another rank's expert
    w = torch.rand(rows, K, device="cuda")
    want = m._forward_loop(x, ids, w)
    got = fused_moe.fused_experts(x.bfloat16(), ids, w.bfloat16(), m.gate_up_proj.bfloat16(),
                                  m.down_proj.bfloat16())
    assert got.dtype == torch.bfloat16
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel


@cuda
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 2e-2)])
def test_cuda_attention_runs_match_reference(cp, dtype, tol):
    torch.manual_seed(1)
    lens = [1000, 37, 2048]
    split = CPSplit.build(lens, cp, "zigzag")
    k = torch.randn(sum(lens), 4, 128, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens), 4, 128, device="cuda", dtype=dtype)
    for r in range(cp):
        pos, seq = split.local_positions(r), split.local_token_to_seq(r)
        q = torch.randn(pos.numel(), 32, 128, device="cuda", dtype=dtype)
        cu = list(split.cu_seqlens)
        want = att.prefill_attention(q.float().cpu(), pos, seq, k.float().cpu(),
                                     v.float().cpu(), cu, 128 ** -0.5)
        got = att.prefill_attention(q, pos.cuda(), seq.cuda(), k, v, cu, 128 ** -0.5,
                                    att.query_runs(pos, seq)).float().cpu()
        rel = (got - want).norm() / want.norm()
        assert rel < tol, (r, rel)


@cuda
@pytest.mark.parametrize("cp", [1, 2])
def test_varlen_runs_match_reference(cp):
    """Many short sequences (past the per-run launch threshold): prefill and the chunk's
    attention with lse in one varlen flash launch, bf16 against the CPU float32 path. The
    tolerance is bf16's: inputs rounded to 8 bits of mantissa (2^-9 relative) and the
    output once more; 2e-2 relative in norm, as for the per-run kernels above."""
    torch.manual_seed(4)
    lens = torch.randint(1, 300, (40,)).tolist()
    split = CPSplit.build(lens, cp, "zigzag")
    cu = list(split.cu_seqlens)
    k = torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = k.float().cpu(), v.float().cpu()
    for r in range(cp):
        pos, seq = split.local_positions(r), split.local_token_to_seq(r)
        q = torch.randn(pos.numel(), 32, 128, device="cuda", dtype=torch.bfloat16)
        runs = att.query_runs(pos, seq)
        packed = att.PackedRuns.build(runs, cu, torch.device("cuda"))
        want = att.prefill_attention(q.float().cpu(), pos, seq, kc, vc, cu, 128 ** -0.5)
        got = att.prefill_attention(q, pos.cuda(), seq.cuda(), k, v, cu, 128 ** -0.5, runs,
                                    packed).float().cpu()
        assert (got - want).norm() / want.norm() < 2e-2, r
        want_o, want_lse = att.chunk_attention_with_lse(q.float().cpu(), pos, seq, kc, vc, cu,
                                                        128 ** -0.5, None)
        o, lse = att.chunk_attention_with_lse(q, pos.cuda(), seq.cuda(), k, v, cu,
                                              128 ** -0.5, packed)
        assert (o.float().cpu() - want_o).norm() / want_o.norm() < 2e-2, r
        assert (lse.cpu() - want_lse).abs().max() < 5e-2, r  # lse of O(1) scores, bf16 inputs


@cuda
def test_prefix_partial_varlen_matches_reference():
    """Rows of several sequences against their cached slots in a paged pool (one sequence
    without slots here): one gather + one varlen launch, bf16, against the CPU float32
    path; tolerances as above."""
    torch.manual_seed(5)
    pool_k = torch.randn(64, 16, 4, 128, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.randn(64, 16, 4, 128, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(64 * 16)
    rows, slots, row = [], [], 0
    for n_rows, n_slots in [(100, 700), (3, 1), (50, 0), (1, 200)]:
        rows.append(torch.arange(row, row + n_rows))
        slots.append(perm[:n_slots])
        perm, row = perm[n_slots:], row + n_rows
    q = torch.randn(row + 5, 32, 128, device="cuda", dtype=torch.bfloat16)
    want_o, want_lse = att.prefix_partial(
        q.float().cpu(), att.PackedPrefix.build(rows, slots, torch.device("cpu")),
        pool_k.float().cpu(), pool_v.float().cpu(), 128 ** -0.5)
    o, lse = att.prefix_partial(q, att.PackedPrefix.build(rows, slots, torch.device("cuda")),
                                pool_k, pool_v, 128 ** -0.5)
    assert (o.cpu() - want_o).norm() / want_o.norm() < 2e-2
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert (lse.cpu()[seen] - want_lse[seen]).abs().max() < 5e-2


@cuda
def test_model_on_cuda_matches_cpu_float32(tmp_path, monkeypatch):
    monkeypatch.setenv("CPMOE_CACHE_DIR", str(tmp_path))
    from cpmoe.default_model import ensure_default_model
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups
    d = ensure_default_model()
    seqs = [torch.randint(0, 259, (n,)).tolist() for n in (300, 7, 1)]
    cpu = ModelRunner(d, ProcessGroups.single("cpu"), torch.float32, show_progress=False)
    gpu = ModelRunner(d, ProcessGroups.single("cuda"), torch.float32, show_progress=False)
    diff = (cpu.prefill(seqs) - gpu.prefill(seqs).cpu()).abs().max().item()
    assert diff < 1e-3, diff


@cuda
def test_triton_ops_match_references_at_model_shapes():
    from cpmoe import ops
    assert ops.triton is not None, "the GPU machine has Triton"
    torch.manual_seed(3)
    dev, bf = "cuda", torch.bfloat16
    h = torch.randn(3000, 1536, device=dev, dtype=bf)
    torch.testing.assert_close(ops.silu_and_mul(h), ops.silu_and_mul_ref(h), rtol=2e-2,
                               atol=2e-2)
    y = torch.randn(24000, 2048, device=dev, dtype=bf)
    idx = torch.randint(0, 24000, (3000, 8), device=dev)
    w = torch.rand(3000, 8, device=dev, dtype=bf)
    torch.testing.assert_close(ops.weighted_row_sum(y, idx, w), ops.weighted_row_sum_ref(y, idx, w),
                               rtol=2e-2, atol=2e-2)
    cos = torch.rand(1000, 64, device=dev).repeat(1, 2)
    sin = torch.rand(1000, 64, device=dev).repeat(1, 2)
    for heads, weight in ((32, torch.rand(128, device=dev, dtype=bf)), (4, None)):
        proj = torch.randn(1000, heads * 128 + 7, device=dev, dtype=bf)  # strided rows
        x = proj[:, :heads * 128].view(1000, heads, 128)
        torch.testing.assert_close(ops.norm_rope(x, weight, 1e-6, cos.to(bf), sin.to(bf)),
                                   ops.norm_rope_ref(x, weight, 1e-6, cos.to(bf), sin.to(bf)),
                                   rtol=2e-2, atol=2e-2)
    # decode QKV: q/k norm + RoPE and the k/v cache stores, at Qwen3-30B-A3B's head shape
    qkv = torch.randn(64, (32 + 2 * 4) * 128, device=dev, dtype=bf)
    slots = torch.randperm(4096, device=dev)[:64]
    caches = [torch.zeros(256, 16, 4, 128, device=dev, dtype=bf) for _ in range(4)]
    nw = torch.rand(128, device=dev, dtype=bf)
    q = ops.qkv_norm_rope_store(qkv, 32, 4, nw, nw, 1e-6, cos[:64].to(bf), sin[:64].to(bf),
                                *caches[:2], slots)
    q_ref = ops.qkv_norm_rope_store_ref(qkv, 32, 4, nw, nw, 1e-6, cos[:64].to(bf),
                                        sin[:64].to(bf), *caches[2:], slots)
    torch.testing.assert_close(q, q_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(caches[0], caches[2], rtol=2e-2, atol=2e-2)
    assert torch.equal(caches[1], caches[3])  # v is copied as it is
    # FP8 pools (--kv-cache-dtype): the kernel's stores equal torch's conversion bit for bit
    # (round to bf16, times 1 / scale, then to nearest FP8, saturating); some v past the
    # range. v is copied as it is, so its codes are torch's of the same input; k goes through
    # the kernel's norm + RoPE, whose bf16 result may differ from the torch path's by an ulp
    # (checked with bf16's tolerance above), so its codes are compared with torch's
    # conversion of the kernel's own bf16 k (what the kernel stores into a bf16 pool)
    qkv[::7, 36 * 128 + 5] = 3e4
    k16 = torch.zeros(256, 16, 4, 128, device=dev, dtype=bf)
    ops.qkv_norm_rope_store(qkv, 32, 4, nw, nw, 1e-6, cos[:64].to(bf), sin[:64].to(bf),
                            k16, torch.zeros_like(k16), slots)
    k16 = k16.view(-1, 4, 128)[slots]
    v16 = qkv[:, 36 * 128:].reshape(64, 4, 128)
    kv_scale = torch.empty(4, device=dev)
    ops.fill_kv_scale(kv_scale, 0.0173, 91.0)
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        # unit scales, then a checkpoint's K/V scales (read from the device)
        for scale in (None, kv_scale):
            caches = [torch.zeros(256, 16, 4, 128, device=dev, dtype=fmt) for _ in range(2)]
            ops.qkv_norm_rope_store(qkv, 32, 4, nw, nw, 1e-6, cos[:64].to(bf),
                                    sin[:64].to(bf), *caches, slots, scale)
            inv = (None, None) if scale is None else (scale[2], scale[3])
            for name, cache, x, inv_x in (("k", caches[0], k16, inv[0]),
                                          ("v", caches[1], v16, inv[1])):
                got = cache.view(-1, 4, 128)[slots].view(torch.uint8)
                want = ops.to_kv_cache(x, fmt, inv_x).view(torch.uint8)
                bad = (got != want).nonzero()
                assert bad.numel() == 0, (
                    f"{fmt} {name} scale={scale is not None}: {bad.shape[0]} codes differ, "
                    f"first at {bad[:4].tolist()}: input {x[tuple(bad[:4].t())].tolist()} "
                    f"stored {got[tuple(bad[:4].t())].tolist()} "
                    f"torch {want[tuple(bad[:4].t())].tolist()}")
            if scale is None:
                top = caches[1].float().view(-1, 4, 128)[slots[::7], 0, 5]
                # e4m3 saturates at 448; e5m2: 3e4 -> bf16 29952 -> 28672 (steps of 4096)
                assert top.eq(448.0 if fmt == torch.float8_e4m3fn else 28672.0).all(), top
    # residual add + RMSNorm: the sum exactly as torch's bf16 add, the norm within bf16
    x, r = torch.randn(64, 2048, device=dev, dtype=bf), torch.randn(64, 2048, device=dev, dtype=bf)
    out, summed = ops.add_rms_norm(x, r, nw.repeat(16), 1e-6)
    assert torch.equal(summed, x + r)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x + r, (2048,), nw.repeat(16),
                                                                 1e-6), rtol=2e-2, atol=2e-2)
    logits = torch.randn(5000, 128, device=dev, dtype=bf)  # bf16: many exact ties
    ids, w = ops.softmax_topk(logits, 8, True, bf)
    # softmax is monotonic: the k largest logits in order, ties to the lower id (torch.topk
    # orders ties as it likes, so it is not the reference for the ids)
    want = torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :8]
    assert torch.equal(ids, want)
    probs = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    torch.testing.assert_close(w, (probs / probs.sum(-1, keepdim=True)).to(bf), rtol=2e-2,
                               atol=2e-2)
    # against the torch reference, expert by expert, on the rows without a tie at the top-8
    # cut (there both pick the same set; sums of renormalised weights are 1 on both sides
    # and would prove nothing)
    ref_ids, ref_w = ops.softmax_topk_ref(logits, 8, True, bf)
    ranked = torch.sort(logits.float(), dim=-1, descending=True).values
    clear = ranked[:, 7] > ranked[:, 8]
    assert clear.float().mean() > 0.5
    dense = torch.zeros(5000, 128, device=dev).scatter_(1, ids.long(), w.float())
    ref_dense = torch.zeros(5000, 128, device=dev).scatter_(1, ref_ids.long(), ref_w.float())
    torch.testing.assert_close(dense[clear], ref_dense[clear], rtol=2e-2, atol=2e-2)
    o1, o2 = (torch.randn(3000, 32, 128, device=dev, dtype=bf) for _ in range(2))
    l1, l2 = torch.randn(3000, 32, device=dev), torch.randn(3000, 32, device=dev)
    out = torch.empty_like(o1)
    want = ops.merge_partials(torch.stack([o1, o2]), torch.stack([l1, l2])).to(bf)
    torch.testing.assert_close(ops.merge_two_attention(o1, l1, o2, l2, out), want, rtol=2e-2,
                               atol=2e-2)


@cuda
def test_v4_triton_ops_match_references_at_model_shapes():
    """DeepSeek-V4's clamped SwiGLU (halves of packed expert rows, I 2048) and float32-weight
    RMSNorm (H 4096) on CUDA in bf16 against their torch expressions: one rounding against
    the expressions' several, within 2e-2."""
    from cpmoe import ops
    from cpmoe.models.layers import RMSNorm
    torch.manual_seed(4)
    dev, bf = "cuda", torch.bfloat16
    h = torch.randn(3000, 2 * 2048, device=dev, dtype=bf) * 6
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(ops.clamped_swiglu(gate, up, 10.0),
                               ops.clamped_swiglu_ref(gate, up, 10.0), rtol=2e-2, atol=2e-2)
    x = torch.randn(3000, 4096, device=dev, dtype=bf) * 3
    norm = RMSNorm(4096, 1e-6, torch.float32).to(dev)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(4096, device=dev) + 0.5)
    xf = x.float()
    want = (norm.weight * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(bf)
    torch.testing.assert_close(norm(x), want, rtol=2e-2, atol=2e-2)
