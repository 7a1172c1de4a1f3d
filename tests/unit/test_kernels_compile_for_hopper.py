"""The FP8 kernels' CUDA variants compile for the H200 (sm_90), without a GPU.

The interpreter tests run every kernel's arithmetic on CPU, but not Triton's CUDA compiler,
which refuses programs the interpreter runs (functions returning differently typed values
from constexpr branches did, at b22ae70). Here Triton compiles the variants the decode step
launches ahead of time for an sm_90 target (ptxas ships with Triton), with the 16-byte
alignment real launches specialize on, so the software pipeline and the MMA choice are the
ones a launch gets: the W8A8 expert GEMM with the weights on either side of the dot
(SWAP_AB must reach Hopper's warp-group MMA) and quantizing its output (QUANT_OUT), and the
skinny GEMM adding its split K in the last program (LAST_SUMS: GPU-scope acq_rel atomics),
and the prefill's grouped GEMM; in none of them does a load in the K loop wait (Triton
pipelines the tiles' loads, not the scales': those are read before the loop).
In a subprocess: cpmoe imports Triton only for a CUDA build of torch, which it is told it is.
"""

import importlib.util
import subprocess
import sys

import pytest

from tests._interpreter import REPO_ROOT

_SCRIPT = r"""
import inspect
import unittest.mock

import torch
unittest.mock.patch.object(torch.version, "cuda", "13.0").start()  # Triton gets imported
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cpmoe.moe import fused_moe
from cpmoe.quant import kernels


def compile_sm90(fn, pointers, constexprs, unaligned, options):
    # pointers {name: Triton type}; other non-constexpr arguments int32, `limit` float32;
    # every argument not in `unaligned` 16-divisible, as launches specialize them
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else pointers.get(p, "fp32" if p == "limit"
                                                              else "i32") for p in params}
    aligned = [i for i, p in enumerate(params) if sig[p] != "constexpr" and p not in unaligned]
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm


def k_loop(ttgir):
    # the innermost loop with pipelined copies: from its scf.for to its first scf.yield
    lines = ttgir.splitlines()
    starts = [i for i, line in enumerate(lines) if "scf.for" in line]
    for i in reversed(starts):
        body = lines[i:next(j for j in range(i, len(lines)) if "scf.yield" in lines[j])]
        if any("async_copy_global_to_local" in line for line in body):
            return "\n".join(body)
    raise AssertionError("no pipelined loop")


E, H, I = 128, 2048, 768
for slots, swap, block_n, quant_out in ((512, False, 64, False), (512, True, 64, False),
                                        (512, True, 128, True), (8, True, 128, False)):
    for gated, k_dim in ((True, H), (False, I)):
        cfg = dict(fused_moe.gemm_config(slots, E, k_dim, True, "w8a8"), SWAP_AB=swap,
                   BLOCK_N=block_n)
        options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
        q_out = quant_out and gated
        asm = compile_sm90(
            fused_moe._expert_gemm_kernel,
            {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
             "slots_ptr": "*i32", "counts_ptr": "*i32", "os_ptr": "*fp32",
             "out_ptr": "*fp8e4nv" if q_out else "*bf16"},
            dict(cfg, GATED=gated, E_POW2=E, SCALED=True, UPCAST=False, CLAMP=False,
                 K_PIECES=1, KB_POW2=k_dim // 128 if gated else 8, QUANT_OUT=q_out,
                 ROUND_TO=1),
            ("cap", "limit", "rows_per_a", "stride_as_k"), options)
        # the weight tiles pipelined, and no load in the K loop waits (the scales are read
        # before it)
        assert "tt.load" not in k_loop(asm["ttgir"]), (slots, swap, gated)
        assert ("wgmma" in asm["ptx"]) == swap, (slots, swap, gated)
for last in (False, True):
    cfg = dict(kernels.skinny_config(64, 2048, 4096), LAST_SUMS=last)
    options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    asm = compile_sm90(
        kernels._skinny_fp8_kernel,
        {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
         "b_ptr": "*bf16", "part_ptr": "*fp32", "out_ptr": "*bf16", "arrivals_ptr": "*i32"},
        dict(cfg, HAS_BIAS=True, BLOCK_M=64, GROUPS_POW2=8, UPCAST=False),
        ("M", "stride_xs_g"), options)
    assert ("atom.global.gpu.acq_rel.add" in asm["ptx"]) == last
    assert "tt.load" not in k_loop(asm["ttgir"])
cfg = kernels.grouped_fp8_config(16384 * 8, E)
asm = compile_sm90(
    kernels._grouped_fp8_kernel,
    {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
     "out_ptr": "*bf16", "starts_ptr": "*i64", "ends_ptr": "*i64", "tile_end_ptr": "*i64",
     "tiles_ptr": "*i64", "tile_expert_ptr": "*i64"},
    {"E": E, "BN_Q": 128, "BM": cfg["BM"], "BN": cfg["BN"], "BK": 128, "KB_POW2": 16,
     "UPCAST": False}, ("P", "as_s0", "ws_s2"),
    {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
assert "tt.load" not in k_loop(asm["ttgir"]) and "wgmma" in asm["ptx"]
print("compiled")
"""


def _nvidia_backend() -> bool:
    try:
        return importlib.util.find_spec("triton.backends.nvidia") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend not installed")
def test_fp8_kernels_compile_for_sm90() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
