"""The tiles of two FP8 kernels in Triton's CPU interpreter (skipped without Triton).

- `quantize_act`'s kernel, one [BLOCK_M, group] tile a program: values and scales equal
  `quantize_act_ref` for row counts that are not a multiple of BLOCK_M, for padded rows
  (rows > M: zero values and scales, whatever the fresh buffers held) and for every BLOCK_M
  tried. Exactly on rows whose quantization rounds nothing (the interpreter's float32 -> FP8
  cast drops the carry when rounding up crosses a power of two, rounds ties away from zero
  and FP8 subnormals off by up to one step; the GPU's does none of these: see
  tests/unit/test_fp8_kernels.py), and on random float32 rows (no ties) up to those.
  tests/gpu/test_fp8_cuda.py checks bit equality on random bf16 rows on the GPU.
- `grouped_fp8_gemm`'s output is allocated uninitialized: rows past offs[-1] (other EP
  ranks' slots) are written as zeros by the kernel's spare tile slots, even when the fresh
  memory held NaN, and the rest equals `grouped_fp8_gemm_ref`, for tiles that span two
  weight scale blocks and for tiles inside one, for each way of loading tiles (`TMA_MODES`)
  and with the rows read through `a_rows`; with `swiglu` (gate/up computing its SwiGLU,
  plain or clamped) it equals the SwiGLU of the reference's gate and up rows.
"""

import importlib.util

import pytest

from tests._interpreter import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton not installed")

_QUANTIZE = r"""
import torch
from cpmoe.ops import fp8, fp8_gemm
FP8 = torch.float8_e4m3fn
torch.manual_seed(0)
empty = torch.empty
# fresh buffers hold NaN (the kernel must write every element it returns)
torch.empty = lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))


def exact_rows(M, K, group):
    # FP8 values times a power of two per group, 448 in every group, one all-zero group
    q = (torch.randn(M, K) * 64).clamp(-448, 448).to(FP8).float()
    q[:, ::group] = 448.0
    x = q * 2.0 ** torch.randint(-10, 4, (M, K // group)).float().repeat_interleave(group, 1)
    x[M // 2, :group] = 0.0
    return x


def check(x, group, rows, cfg, exact):
    M, K = x.shape
    q, s = fp8.quantize_act(x, group, rows, config=cfg)
    qr, sr = fp8.quantize_act_ref(x, group)
    assert q.shape == (rows, K) and s.shape == (rows, K // group) and s.stride() == (1, rows)
    assert torch.equal(s[:M], sr), cfg
    assert torch.equal(s[M:], torch.zeros_like(s[M:]))
    assert torch.equal(q[M:].float(), torch.zeros(rows - M, K))
    qf, rf = q[:M].float(), qr.float()
    if exact:
        assert torch.equal(q[:M].view(torch.uint8), qr.view(torch.uint8)), cfg
    else:  # the interpreter's cast (see the module docstring)
        carry = (rf.abs().log2() == rf.abs().log2().round()) & (qf == rf / 2)
        subnormal = (rf.abs() < 2 ** -6) & ((qf - rf).abs() <= 2 ** -9)
        assert ((qf == rf) | carry | subnormal).all()


cases = 0
for block_m, warps in ((1, 1), (2, 4), (8, 4), (32, 4)):
    cfg = dict(BLOCK_M=block_m, num_warps=warps)
    for M, K, group in ((7, 256, 128), (37, 96, 32), (1, 128, 128)):
        for rows in (M, M + 3, M + 16):
            check(exact_rows(M, K, group), group, rows, cfg, exact=True)
            # float32: bf16 inputs land on FP8 ties, which the interpreter's cast rounds
            # away from zero (the GPU's to even)
            x = torch.randn(M, K) * torch.logspace(-3, 3, M)[:, None]
            check(x, group, rows, cfg, exact=False)
            cases += 1
# the default tiles, decode and prefill sizes
assert fp8.quantize_config(1)["BLOCK_M"] == 1 and fp8.quantize_config(16384)["BLOCK_M"] == 32
check(exact_rows(40, 256, 128), 128, 48, None, exact=True)
print("quantize tiles ok", cases)
"""


@needs_triton
def test_quantize_act_tiles_match_quantize_act_ref_in_the_interpreter() -> None:
    out = run_interpreted(_QUANTIZE, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "quantize tiles ok" in out.stdout


_TAIL = r"""
import torch
from cpmoe.ops import fp8, fp8_gemm
from cpmoe.ops.fp8 import quantize_block_fp8
torch.manual_seed(0)
empty = torch.empty
# garbage in fresh memory: NaN in float buffers (the output), -7 in integer ones (the
# tile map), so every element the kernels leave unwritten shows
torch.empty = lambda *a, **kw: (lambda t: t.fill_(float("nan") if t.is_floating_point()
                                                  else -7))(empty(*a, **kw))

cases = 0
# (P, offs, BM): one row an expert (the most experts' tiles for the rows), a long tail over
# many tiles, no local rows at all, an expert straddling tiles, a tail shorter than a tile
for P, offs, BM in ((100, [1, 2, 3, 4], 16), (70, [0, 5, 5, 6], 16), (40, [0, 0, 0, 0], 16),
                    (150, [40, 40, 90, 130], 64), (33, [31], 16), (20, [20, 20], 16)):
    E, N, K, block = len(offs), 48, 64, (16, 32)
    pairs = [quantize_block_fp8(torch.randn(N, K), block) for _ in range(E)]
    wq, ws = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    aq, a_s = fp8.quantize_act_ref(torch.randn(P, K), block[1])
    offs = torch.tensor(offs)
    # 32-column tiles read a weight scale per column (two scale blocks a tile), 16-column
    # tiles one scale a tile (the path of 128 x 128 blocks)
    for dtype, BN in ((torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 16)):
        cfg = {"BM": BM, "BN": BN, "num_warps": 4, "num_stages": 1}
        got = fp8_gemm.grouped_fp8_gemm(aq, a_s, wq, ws, offs, block, dtype, config=cfg)
        want = fp8_gemm.grouped_fp8_gemm_ref(aq, a_s, wq, ws, offs, block, dtype)
        L = int(offs[-1])
        assert torch.equal(got[L:], torch.zeros(P - L, N, dtype=dtype)), (P, offs, dtype)
        # bf16: the interpreter's cast truncates (torch's rounds), one bf16 step apart
        tol = (1e-5, 1e-4) if dtype == torch.float32 else (2 ** -7, 1e-2)
        torch.testing.assert_close(got[:L].float(), want[:L].float(), rtol=tol[0], atol=tol[1])
        cases += 1
    # each tile load (TMA_MODES: by address, the weights by TMA descriptor, the rows too),
    # each slot's row read through a_rows from shuffled token rows or from a gathered copy
    toks = P // 2 + 1
    tq, ts = fp8.quantize_act_ref(torch.randn(toks, K), block[1])
    src = torch.randint(0, toks, (P,))
    want = fp8_gemm.grouped_fp8_gemm_ref(tq[src], ts[src], wq, ws, offs, block, torch.float32)
    for tma in fp8_gemm.TMA_MODES:
        cfg = {"BM": BM, "BN": 16, "num_warps": 4, "num_stages": 1, "TMA": tma}
        for got in (fp8_gemm.grouped_fp8_gemm(tq, ts, wq, ws, offs, block, torch.float32,
                                              config=cfg, a_rows=src),
                    fp8_gemm.grouped_fp8_gemm(tq[src], ts[src], wq, ws, offs, block,
                                              torch.float32, config=cfg)):
            L = int(offs[-1])
            assert torch.equal(got[L:], torch.zeros(P - L, N)), (P, offs, tma)
            torch.testing.assert_close(got[:L], want[:L], rtol=1e-5, atol=1e-4)
            cases += 1
    # gate/up with its SwiGLU (swiglu=True): gate rows then up rows [E, 2I, K] -> [P, I],
    # the SwiGLU (plain, or clamped at a limit) by the test's own arithmetic of the gate and
    # up rows the unfused GEMM writes (float32: also within the float32 reference's
    # tolerance); tail rows zero. bf16: the SwiGLU's one rounding by the interpreter's
    # truncating cast against torch's, one bf16 step
    inter = 32
    pairs = [quantize_block_fp8(torch.randn(2 * inter, K), block) for _ in range(E)]
    gq, gs = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    h32 = fp8_gemm.grouped_fp8_gemm_ref(tq[src], ts[src], gq, gs, offs, block, torch.float32)
    cfg = {"BM": BM, "BN": 16, "num_warps": 4, "num_stages": 1, "TMA": ""}
    for dtype, limit in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 1.5)):
        h = fp8_gemm.grouped_fp8_gemm(tq, ts, gq, gs, offs, block, dtype, config=cfg,
                                      a_rows=src).float()
        g, u = h[:, :inter], h[:, inter:]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        want = (g / (1 + torch.exp(-g)) * u).to(dtype).float()
        got = fp8_gemm.grouped_fp8_gemm(tq, ts, gq, gs, offs, block, dtype, config=cfg,
                                        a_rows=src, swiglu=True, limit=limit)
        L = int(offs[-1])
        assert got.shape == (P, inter) and got.dtype == dtype
        assert torch.equal(got[L:].float(), torch.zeros(P - L, inter)), (P, offs, dtype)
        tol = (1e-6, 1e-6) if dtype == torch.float32 else (2 ** -7, 1e-6)
        torch.testing.assert_close(got[:L].float(), want[:L], rtol=tol[0], atol=tol[1])
        if dtype == torch.float32:
            g32, u32 = h32[:, :inter], h32[:, inter:]
            torch.testing.assert_close(got[:L], (g32 / (1 + torch.exp(-g32)) * u32)[:L],
                                       rtol=1e-5, atol=1e-4)
        cases += 1
print("gemm tail ok", cases)
"""


@needs_triton
def test_grouped_fp8_gemm_zeroes_rows_past_offs_in_uninitialized_memory() -> None:
    out = run_interpreted(_TAIL, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gemm tail ok" in out.stdout


_SWIGLU = r"""
import torch
from cpmoe import ops
from cpmoe.ops import fp8, fp8_gemm
from cpmoe.ops.fp8 import dequantize
torch.manual_seed(0)

cases = 0
for P, inter, group in ((37, 256, 128), (5, 96, 32), (1, 128, 128)):
    for dtype in (torch.bfloat16, torch.float32):
        h = (torch.randn(P, 2 * inter) * 3).to(dtype)
        for limit in (None, 2.0):
            gate, up = h.chunk(2, dim=-1)
            act = ops.silu_and_mul(h) if limit is None else ops.activation._swiglu(gate, up, limit)
            for block_m in (1, 4, 16):
                cfg = dict(BLOCK_M=block_m, num_warps=4)
                q, s = fp8.swiglu_quantize(h, group, limit, config=cfg)
                # the unfused Triton path, bit for bit (the same interpreter casts)
                qu, su = fp8.quantize_act(act, group, config=cfg)
                assert s.stride() == (1, P) and torch.equal(s, su), (P, dtype, limit)
                assert torch.equal(q.view(torch.uint8), qu.view(torch.uint8))
                cases += 1
            # the torch references: silu_and_mul_ref rounds SiLU and the product each to
            # the dtype (the kernels round once), and torch's casts are not the
            # interpreter's, so the activations may differ by a couple of bf16 steps
            # (2^-7 each): scales within 2^-5, dequantized values within one FP8 step
            # (2^-3 of the value, or 2^-9 of the scale among subnormals) of each other.
            # On the GPU (one rounding, RNE casts) tests/gpu/test_fp8_cuda.py asks equality.
            ref = (ops.silu_and_mul_ref(h) if limit is None
                   else ops.clamped_swiglu_ref(gate, up, limit))
            qr, sr = fp8.quantize_act_ref(ref, group)
            torch.testing.assert_close(s, sr, rtol=2 ** -5, atol=0)
            # the interpreter's dropped carry (a rounding up to 2^(e+1) gives 2^e) undone
            qf, rf = q.float(), qr.float()
            dropped = (qf.abs().log2() == qf.abs().log2().round()) & (rf.abs() > 1.5 * qf.abs())
            got = dequantize(torch.where(dropped, 2 * qf, qf), s, (1, group))
            want = dequantize(qr, sr, (1, group))
            step = 2 ** -3 * torch.maximum(got.abs(), want.abs()) + 2 ** -9 * (
                sr.repeat_interleave(group, 1))
            assert ((got - want).abs() <= step * 1.05).all()
print("swiglu quantize ok", cases)
"""


@needs_triton
def test_swiglu_quantize_matches_swiglu_then_quantize_act_in_the_interpreter() -> None:
    out = run_interpreted(_SWIGLU, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "swiglu quantize ok" in out.stdout


_NORM_QUANT = r"""
import torch
from cpmoe import ops
from cpmoe.ops import fp8, fp8_gemm
torch.manual_seed(0)

cases = 0
# hidden a power of two and not (the row tile then holds groups past the row: not written)
for n, hidden, group in ((5, 256, 128), (3, 384, 128), (1, 96, 32)):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(n, hidden).to(dtype)
        r = (torch.randn(n, hidden) * 4).to(dtype)
        w = (torch.rand(hidden) + 0.5).to(dtype)
        out, summed = ops.add_rms_norm(x, r, w, 1e-6, quant_group=group)
        out0, summed0 = ops.add_rms_norm(x, r, w, 1e-6)  # the pass without quantization
        assert torch.equal(out, out0) and torch.equal(summed, summed0)
        q, s = fp8.quantize_act(out, group)  # the offer, taken as is
        # quantize_act's own kernel on a copy (not the offered memory): bit for bit, the
        # same interpreter casts
        qu, su = fp8.quantize_act(out.clone(), group)
        assert q is not qu and s.stride() == (1, n) and torch.equal(s, su), (n, hidden)
        assert torch.equal(q.view(torch.uint8), qu.view(torch.uint8)), (n, hidden, dtype)
        cases += 1
print("norm quantize ok", cases)
"""


@needs_triton
def test_add_rms_norm_quantizes_its_rows_as_quantize_act_in_the_interpreter() -> None:
    out = run_interpreted(_NORM_QUANT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "norm quantize ok" in out.stdout
