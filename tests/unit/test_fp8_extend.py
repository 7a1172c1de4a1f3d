"""FP8 extend attention (`--kv-cache-dtype fp8_e4m3`, CUDA): the chunk of a long prompt
after its cached prefix runs its own keys and the prefix in FP8 through `fp8_attention`, as
a whole prefill does. cuDNN is not here, so these tests replace `fp8_attention` by float32
attention with the same interface (`emulate`: FP8 inputs taken times their descales, the
causal mask top-left aligned as cuDNN's FP8 kernel has it on Hopper) and let the FP8 paths
run on CPU; the paths must then give what the 16-bit paths give (tests/e2e/test_hf_parity.py
holds those to HF). What they prove is the dispatch: runs sliced and split at their first
position, the two parts merged with their log-sum-exp, each prefix sequence's rows and
codes, the pools' scales as descales, rows scattered back, and the model taking the path.
The kernel's own error is tests/gpu/test_fp8_attention_cuda.py's."""

from __future__ import annotations

import pytest
import torch

import cpmoe.cp.fp8_attention as fa
from cpmoe.cp import attention as att
from cpmoe.cp.split import CPSplit
from cpmoe.ops import fill_kv_scale

CALLS: list[tuple[int, int, bool, bool]] = []  # (rows, keys, causal, fp8 keys) per call


def emulate(q, k, v, scale, causal, lse=False, k_descale=None, v_descale=None, out=None,
            q_descale=None):
    """fp8_attention's interface in float32, no quantization; records each call."""
    fp8 = k.dtype == torch.float8_e4m3fn
    CALLS.append((q.shape[0], k.shape[0], causal, fp8))
    qf = q.float() * q_descale.view(()) if q_descale is not None else q.float()
    kf = k.float() * k_descale.view(()) if fp8 else k.float()
    vf = v.float() * v_descale.view(()) if fp8 else v.float()
    group = q.shape[1] // k.shape[1]
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = torch.einsum("nhd,mhd->hnm", qf, kf) * scale
    if causal:
        n = q.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hnm,mhd->nhd", s.softmax(-1), vf).to(
        q.dtype if q_descale is None else v.dtype)
    o = o if out is None else out.copy_(o)
    return o, (torch.logsumexp(s, -1).t().contiguous() if lse else None)


# a 1,024-row run's causal square: the model test's 1,100-token chunks go FP8 (the real
# threshold, an 8K square, would need prompts too large for float32 attention on CPU)
SMALL_PAIRS = 1024 * 1025 // 2


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setattr(fa, "fp8_attention", emulate)
    monkeypatch.setattr(att, "_fp8_device", lambda q: True)
    monkeypatch.setattr(att, "FP8_MIN_PAIRS", SMALL_PAIRS)
    CALLS.clear()
    return CALLS


def test_fp8_is_worth_it_for_few_runs_of_much_attention():
    """The runner's rule at its real threshold (an 8K chunk's causal square of query-key
    pairs a run, the cached prefix counted): a served batch of 1K prompts, a short prompt's
    zigzag runs and a CP rank's runs of a first 8K chunk stay 16-bit; a 16K prompt, an 8K
    chunk, the same CP runs after a 16K prefix and a 1K run late in a long prompt go FP8;
    never past 16 runs."""
    assert att.run_pairs((0, 8192, 0, 0)) == att.FP8_MIN_PAIRS == 8192 * 8193 // 2
    assert not att.fp8_worth([(i * 1024, (i + 1) * 1024, i, 0) for i in range(8)], [0] * 8)
    assert not att.fp8_worth([(0, 4096, 0, 0), (4096, 8192, 0, 12288)], [0])
    assert att.fp8_worth([(0, 16384, 0, 0)], [0])
    assert att.fp8_worth([(0, 8192, 0, 0)], [0])
    assert not att.fp8_worth([(0, 8191, 0, 0)], [0])
    zigzag = [(0, 2048, 0, 0), (2048, 4096, 0, 6144)]  # a CP-2 rank's half of an 8K chunk
    assert not att.fp8_worth(zigzag, [0]) and att.fp8_worth(zigzag, [16384])
    assert att.fp8_worth([(0, 1024, 0, 32768)], [0])
    assert not att.fp8_worth([(0, 8192, 0, 0), (8192, 9216, 1, 0)], [0, 0])  # one short
    assert att.fp8_worth([(0, 8192, 0, 0), (8192, 9216, 1, 0)], [0, 40000])
    assert not att.fp8_worth([(0, 8192, i, 0) for i in range(17)], [0] * 17)
    assert not att.fp8_worth([], [])


def test_chunk_runs_in_fp8_equal_the_16_bit_path(fp8_on_cpu):
    """A zigzag CP rank's rows of two sequences (two runs each, the second starting after
    keys of the chunk): FP8 per run equals the per-sequence path, o and lse."""
    torch.manual_seed(0)
    split = CPSplit.build([4400, 4160], 2, "zigzag")
    pos, seq = split.local_positions(0), split.local_token_to_seq(0)
    runs = att.query_runs(pos, seq)
    assert len(runs) == 4
    q = torch.randn(pos.numel(), 8, 16)
    k, v = torch.randn(8560, 2, 16), torch.randn(8560, 2, 16)
    cu = list(split.cu_seqlens)
    o, lse = att.chunk_attention_with_lse(q, pos, seq, k, v, cu, 0.25, None, runs, True)
    want_o, want_lse = att.chunk_attention_with_lse(q, pos, seq, k, v, cu, 0.25, None)
    torch.testing.assert_close(o.float(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    # a run at its sequence's start: one causal call; a later one: causal + the keys before
    assert sorted(c[2] for c in fp8_on_cpu) == [False, False, True, True, True, True]
    assert att.fp8_runs_apply(q, runs, True) and not att.fp8_runs_apply(q, runs, False)


def test_cached_prefix_in_fp8_reads_the_codes_with_their_scales(fp8_on_cpu):
    """Two sequences' rows (not in order) against their slots of e4m3 pools with a layer's
    K/V scales: the codes go to fp8_attention as they are, the scales as descales, and the
    result equals the widening path; rows of no packed sequence see nothing."""
    torch.manual_seed(1)
    pool_k = (torch.randn(40, 8, 2, 16) * 20).to(torch.float8_e4m3fn)
    pool_v = (torch.randn(40, 8, 2, 16) * 20).to(torch.float8_e4m3fn)
    rows = [torch.arange(130, 300), torch.arange(0, 130)]  # any sizes: the caller decides
    slots = [torch.randperm(320)[:200], torch.randperm(320)[:77]]
    prefix = att.PackedPrefix.build(rows, slots, torch.device("cpu"))
    kv_scale = torch.empty(4)
    fill_kv_scale(kv_scale, 0.03, 0.7)
    q = torch.randn(310, 8, 16)
    o, lse = att.prefix_partial(q, prefix, pool_k, pool_v, 0.25, kv_scale, fp8=True)
    want_o, want_lse = att.prefix_partial(q, prefix, pool_k, pool_v, 0.25, kv_scale)
    torch.testing.assert_close(o.float(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse[300:]).all() and not o[300:].any()
    assert fp8_on_cpu == [(170, 200, False, True), (130, 77, False, True)]


def test_prefill_runs_offer_their_e4m3_o_to_the_fp8_o_proj(fp8_on_cpu, monkeypatch):
    """`prefill_attention(fp8=True, o_quant_group)`: with every run at its sequence's start,
    each run's O stays e4m3 (`fp8_attention_e4m3`, emulated: float32 attention, then O
    quantized per tensor) and the rows are offered to the FP8 o_proj: codes and per-run
    descales in every group's scale, cuDNN's own buffer when one run covers the rows; runs
    past their start (merged by log-sum-exp), or no FP8 o_proj, dequantize O as before."""
    from types import SimpleNamespace
    from cpmoe.ops.fp8 import offered
    made = []

    def emulate_e4m3(q, k, v, scale, causal, lse=False, k_descale=None, v_descale=None,
                     q_descale=None):
        o, _ = emulate(q, k, v, scale, causal, q_descale=q_descale)
        descale = (o.float().abs().max() / 448).reshape(1)
        codes = (o.float() / descale).to(torch.float8_e4m3fn).contiguous()
        made.append((codes, descale))
        return codes, descale, None

    monkeypatch.setattr(fa, "fp8_attention_e4m3", emulate_e4m3)
    monkeypatch.setattr(att, "launch", SimpleNamespace(use_triton=lambda x: True))
    torch.manual_seed(3)
    for lengths in ((300, 200), (500,)):
        split = CPSplit.build(list(lengths), 1, "zigzag")
        pos, seq = split.local_positions(0), split.local_token_to_seq(0)
        runs, cu = att.query_runs(pos, seq), list(split.cu_seqlens)
        T = pos.numel()
        q, k, v = torch.randn(T, 8, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)
        want = att.prefill_attention(q, pos, seq, k, v, cu, 0.25, runs)
        made.clear()
        o = att.prefill_attention(q, pos, seq, k, v, cu, 0.25, runs, fp8=True,
                                  o_quant_group=64)
        codes, scales = offered(o.view(T, 128), 64)
        assert len(made) == len(runs) == len(lengths) and scales.stride() == (1, T)
        if len(runs) == 1:
            assert codes.data_ptr() == made[0][0].data_ptr()  # the kernel's buffer itself
        for (row0, row1, _, _), (c, d) in zip(runs, made):
            assert torch.equal(codes[row0:row1].view(torch.uint8),
                               c.reshape(row1 - row0, 128).view(torch.uint8))
            assert torch.equal(scales[row0:row1], d.expand(row1 - row0, 2))
        back = (codes.float() * scales.repeat_interleave(64, 1)).view(T, 8, 16)
        # one e4m3 rounding: within 2^-4 of each value, or the subnormal step 2^-9 x scale
        assert ((back - want).abs() <= want.abs() * 2 ** -4 + scales.max() * 2 ** -9
                + 1e-6).all()
    # a zigzag CP rank's runs (the second past its start, merged): O dequantized, no offer
    split = CPSplit.build([600], 2, "zigzag")
    pos, seq = split.local_positions(0), split.local_token_to_seq(0)
    runs, cu = att.query_runs(pos, seq), list(split.cu_seqlens)
    q, k, v = torch.randn(pos.numel(), 8, 16), torch.randn(600, 2, 16), torch.randn(600, 2, 16)
    o = att.prefill_attention(q, pos, seq, k, v, cu, 0.25, runs, fp8=True, o_quant_group=64)
    assert offered(o.view(-1, 128), 64) is None
    torch.testing.assert_close(o, att.prefill_attention(q, pos, seq, k, v, cu, 0.25, runs),
                               rtol=1e-5, atol=1e-5)
    # a 16-bit o_proj (no group): O dequantized
    o = att.prefill_attention(q[:300], pos[:300], seq[:300], k, v, [0, 600], 0.25,
                              [(0, 300, 0, 0)], fp8=True)
    assert offered(o.view(-1, 128), 64) is None


def test_prefill_takes_q_in_e4m3_with_its_descale(fp8_on_cpu):
    """q as `ops.norm_rope_fp8` writes it (e4m3 codes, one descale): a zigzag CP rank's two
    runs (the second merged from its own keys and the keys before it) attend as the 16-bit
    path over q = codes x descale, O in v's dtype; every fp8_attention call got the codes."""
    from cpmoe import ops
    torch.manual_seed(4)
    split = CPSplit.build([600], 2, "zigzag")
    pos, seq = split.local_positions(0), split.local_token_to_seq(0)
    runs, cu = att.query_runs(pos, seq), list(split.cu_seqlens)
    T = pos.numel()
    k, v = torch.randn(600, 2, 16).bfloat16(), torch.randn(600, 2, 16).bfloat16()
    angle = torch.rand(T, 8) * 6.3
    q8, descale = ops.norm_rope_fp8(torch.randn(T, 8, 16).bfloat16(), torch.rand(16) + 0.5,
                                    1e-6, angle.cos().repeat(1, 2), angle.sin().repeat(1, 2))
    assert q8.dtype == torch.float8_e4m3fn and len(runs) == 2 and runs[1][3] > 0
    o = att.prefill_attention(q8, pos, seq, k, v, cu, 0.25, runs, fp8=True, q_descale=descale)
    want = att.prefill_attention((q8.float() * descale).bfloat16(), pos, seq, k, v, cu, 0.25,
                                 runs)
    assert o.dtype == torch.bfloat16 and len(fp8_on_cpu) == 3  # one call, then two merged
    torch.testing.assert_close(o.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_model_takes_the_fp8_extend_path(fp8_on_cpu, qwen3_moe_dir, monkeypatch):
    """A 2,200-token prompt in two chunks of 1,100 over e4m3 pools: with FP8 attention on,
    the first chunk's q comes from the store kernel's e4m3 variant (no cached prefix) in
    every layer, the second chunk's attention (its own keys and the cached 1,100) goes
    through fp8_attention in every layer, and its logits equal the 16-bit path's; at the
    rule's real threshold (`fp8_worth`) the runner keeps such a chunk 16-bit. As
    fp8_attention here, q's e4m3 store is emulated without its rounding (the 16-bit q with
    descale 1; the rounding is tests/unit/test_fp8_attention.py's)."""
    from cpmoe import ops
    from cpmoe.engine.runner import ModelRunner, Segment
    from cpmoe.models.qwen_moe import model as qwen
    from cpmoe.parallel.groups import ProcessGroups

    e4m3_stores = []

    def store_unrounded(*args):
        e4m3_stores.append(args[0].shape[0])
        return ops.qkv_norm_rope_store_ref(*args), torch.ones(1)

    monkeypatch.setattr(qwen, "qkv_norm_rope_store_fp8", store_unrounded)

    ids = torch.randint(0, 256, (2200,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    for fp8 in (False, True):
        runner = ModelRunner(qwen3_moe_dir, ProcessGroups.single(), torch.float32,
                             show_progress=False)
        runner.allocate_kv(2304, kv_dtype="fp8_e4m3")
        runner.fp8_attention = fp8  # what CUDA sets for e4m3 pools of a 16-bit model
        e4m3_stores.clear()
        runner.extend([Segment(0, ids[:1100])])
        fp8_on_cpu.clear()
        logits.append(runner.extend([Segment(0, ids[1100:], 1100)]))
        calls = list(fp8_on_cpu)
    layers = len(runner.model.model.layers)
    assert e4m3_stores == [1100] * layers  # the first chunk only
    assert calls == [(1100, 1100, True, False), (1100, 1100, False, True)] * layers
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(att, "FP8_MIN_PAIRS", 8192 * 8193 // 2)
    runner = ModelRunner(qwen3_moe_dir, ProcessGroups.single(), torch.float32,
                         show_progress=False)
    runner.allocate_kv(2304, kv_dtype="fp8_e4m3")
    runner.fp8_attention = True
    fp8_on_cpu.clear()
    runner.extend([Segment(0, ids[:1100])])
    torch.testing.assert_close(runner.extend([Segment(0, ids[1100:], 1100)]), logits[0],
                               rtol=1e-6, atol=1e-6)
    assert fp8_on_cpu == []
