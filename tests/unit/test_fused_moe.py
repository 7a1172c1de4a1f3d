"""The decode experts' Triton kernels (moe/fused_moe.py) against the experts' loop path, one
matmul pair per expert in float32 (Triton's CPU interpreter, in a subprocess since
TRITON_INTERPRET is read at import; skipped where Triton is not installed). The GPU test in
tests/gpu/test_cuda_paths.py checks bf16 on CUDA."""

import importlib.util

import pytest

from tests._interpreter import run_interpreted

_CASES = r"""
import torch
from cpmoe.moe import fused_moe
from cpmoe.moe.experts import LocalExperts
assert fused_moe.usable(torch.zeros(1), 1), "interpreter not active"
torch.manual_seed(0)
# (rows, top-k, local experts, hidden, intermediate): a row per expert and several rows on
# one expert (more than a 16-row tile), widths off the tile sizes, other ranks' slots (-1);
# fewer slots than experts (2 x 3 < 20: the compact grid, as at batch 1 on 128 experts)
for M, K, E, H, I in ((3, 2, 4, 48, 40), (40, 4, 3, 160, 72), (5, 3, 8, 32, 16),
                      (2, 3, 20, 32, 24)):
    assert fused_moe.gemm_config(M * K, E, H)["COMPACT"] == (M * K < E)
    m = LocalExperts(E, H, I, torch.float32)
    torch.nn.init.normal_(m.gate_up_proj, std=0.2)
    torch.nn.init.normal_(m.down_proj, std=0.2)
    x = torch.randn(M, H)
    ids = torch.stack([torch.randperm(E + 2)[:K] for _ in range(M)]) - 2  # some -1 and -2
    ids = torch.where(ids < 0, -1, ids)
    w = torch.rand(M, K)
    want = m._forward_loop(x, ids, w)
    got = fused_moe.fused_experts(x, ids, w, m.gate_up_proj, m.down_proj)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    none = torch.full_like(ids, -1)  # no slot on this rank: zeros, nothing read
    assert torch.equal(fused_moe.fused_experts(x, none, w, m.gate_up_proj, m.down_proj),
                       torch.zeros_like(x))
# FP8 weights with 128 x 128 block scales (weights-only: x stays float32 here) against the
# loop over the dequantized weights; 2 x 2 blocks of gate, of up and of down
from cpmoe.quant.formats import dequantize, quantize_block_fp8
E, H, I = 3, 256, 256
m = LocalExperts(E, H, I, torch.float32)
torch.nn.init.normal_(m.gate_up_proj, std=0.05)
torch.nn.init.normal_(m.down_proj, std=0.05)
qs = [[quantize_block_fp8(w[e]) for e in range(E)] for w in (m.gate_up_proj, m.down_proj)]
q_gu, q_d = (torch.stack([q for q, _ in ws]) for ws in qs)
s_gu, s_d = (torch.stack([s for _, s in ws]) for ws in qs)
m.gate_up_proj.data = torch.stack([dequantize(q, s, (128, 128)) for q, s in qs[0]])
m.down_proj.data = torch.stack([dequantize(q, s, (128, 128)) for q, s in qs[1]])
x, ids, w = torch.randn(7, H), torch.randint(-1, E, (7, 2)), torch.rand(7, 2)
want = m._forward_loop(x, ids, w)
got = fused_moe.fused_experts(x, ids, w, q_gu, q_d, (s_gu, s_d))
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
# DeepSeek-V4's clamped SwiGLU (limit 0.5 clamps many of these gate/up values)
m = LocalExperts(4, 64, 32, torch.float32)
torch.nn.init.normal_(m.gate_up_proj, std=0.3)
torch.nn.init.normal_(m.down_proj, std=0.3)
m.swiglu_limit = 0.5
x, ids, w = torch.randn(6, 64), torch.randint(-1, 4, (6, 3)), torch.rand(6, 3)
want = m._forward_loop(x, ids, w)
got = fused_moe.fused_experts(x, ids, w, m.gate_up_proj, m.down_proj, swiglu_limit=0.5)
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
m.swiglu_limit = None
assert not torch.allclose(got, m._forward_loop(x, ids, w), atol=1e-3)  # the clamp mattered
print("fused moe ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_fused_decode_experts_match_the_loop_in_the_interpreter() -> None:
    out = run_interpreted(_CASES, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused moe ok" in out.stdout
