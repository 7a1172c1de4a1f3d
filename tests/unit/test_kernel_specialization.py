"""Triton kernels are not recompiled as a served step's row count changes.

Triton specializes every integer argument a kernel does not list in `do_not_specialize`
(and does not take as a constexpr): a value divisible by 16 compiles a variant with that
hint, any other value another. An argument that follows the step's rows (a row count, the
column stride of `quantize_act`'s column-major scales) therefore compiles a new variant, ~1
s on the GPU, the first time a step's token count falls in a new residue class while
serving: on an H200 at 1d2b62c the FP8 server's first step of 8,191 tokens (after steps of
8,192) took 1.32 s against ~0.12 (bench/results/fp8-serving-h200-1d2b62c.log).

Here each kernel's launches are recorded instead of run, on CPU with the CUDA code paths
taken, at row counts of one tile configuration (the experts' tiles are chosen by the rows,
and each choice is its own variant, which the server's warm-up compiles): every integer
argument whose specialization class (equal to 1, divisible by 16, neither) differs between
the launches must be one the kernel does not specialize. In a subprocess: cpmoe imports
Triton only for a CUDA build of torch, which it is told it is.
"""

import importlib.util
import subprocess
import sys

import pytest

from tests._interpreter import REPO_ROOT

_SCRIPT = r"""
import unittest.mock

import torch
unittest.mock.patch.object(torch.version, "cuda", "13.0").start()  # Triton gets imported

from cpmoe.cp import paged_attention
from cpmoe.moe import fused_moe
from cpmoe.ops import fp8_gemm
from cpmoe.ops.fp8 import quantize_act


class Record:
    # a kernel's launches, recorded instead of run: each launch's integer arguments by name
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.kernel.arg_names, args)) | kwargs
            self.calls.append({k: v for k, v in named.items()
                               if isinstance(v, int) and not isinstance(v, bool)})
        return launch

    def specialized_and_varying(self, every=1, first=0):
        # calls first, first + every, ...: the launches of one call site; an argument Triton
        # specializes whose class (1, divisible by 16, other; 32 or 64 bits) differs
        calls = self.calls[first::every]
        free = {p.name for p in self.kernel.params if p.do_not_specialize or p.is_constexpr}
        names = set().union(*calls)
        return sorted(n for n in names - free if len({kind(c.get(n)) for c in calls}) > 1)


def kind(v):
    return None if v is None else (v == 1, v % 16 == 0, -2**31 <= v < 2**31)


def record(module, name):
    rec = Record(getattr(module, name))
    setattr(module, name, rec)
    return rec


# the experts' two grouped FP8 GEMMs as fp8_experts launches them: gate/up reads each slot's
# token row through a_rows, its row scales [tokens, K/128] column-major; down reads the
# SwiGLU's slot rows quantized the same way. 4 experts x top-2, 128 x 128 blocks; token
# counts inside one tile choice (64-row tiles), even, odd and a multiple of 16
E, TOP_K, H, I = 4, 2, 256, 256
grouped = record(fp8_gemm, "_grouped_fp8_kernel")
tiles = record(fp8_gemm, "_tile_map_kernel")
w_up = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn)
w_down = torch.zeros(E, H, I, dtype=torch.float8_e4m3fn)
s_up, s_down = torch.ones(E, 2 * I // 128, H // 128), torch.ones(E, H // 128, I // 128)
configs = set()
for tokens in (48, 47, 64, 61):
    P = tokens * TOP_K
    xq, xs = quantize_act(torch.randn(tokens, H), 128)
    offs = torch.linspace(P // E, P, E).round().long()
    rows = torch.arange(P) // TOP_K
    up_cfg = fp8_gemm.grouped_fp8_config(P, E, a_rows=True, swiglu=True)
    down_cfg = fp8_gemm.grouped_fp8_config(P, E, after_swiglu=True)
    configs.add(str((up_cfg, down_cfg)))
    h = fp8_gemm.grouped_fp8_gemm(xq, xs, w_up, s_up, offs, (128, 128), torch.bfloat16,
                                  config=up_cfg, a_rows=rows, swiglu=True)
    aq, a_s = quantize_act(h.float().nan_to_num().to(torch.bfloat16), 128)
    fp8_gemm.grouped_fp8_gemm(aq, a_s, w_down, s_down, offs, (128, 128), torch.bfloat16,
                              config=down_cfg)
assert len(configs) == 1, configs  # one tile choice: the variants compared are the same
assert len(grouped.calls) == 8 and tiles.calls, (len(grouped.calls), len(tiles.calls))
bad = {"grouped gate/up": grouped.specialized_and_varying(2, 0),
       "grouped down": grouped.specialized_and_varying(2, 1),
       "tile map": tiles.specialized_and_varying()}

# the skinny dense FP8 GEMM (q/k/v and o_proj up to 64 rows) on quantize_act's rows: row
# counts of one BLOCK_M (32)
skinny = record(fp8_gemm, "_skinny_fp8_kernel")
w, ws = torch.zeros(512, 1024, dtype=torch.float8_e4m3fn), torch.ones(4, 8)
for rows in (17, 18, 24, 32):
    fp8_gemm.fp8_linear_skinny(*quantize_act(torch.randn(rows, 1024), 128), w, ws)
assert len({c["BLOCK_M"] for c in skinny.calls}) == 1
bad["skinny"] = skinny.specialized_and_varying()

# the few-slot experts (decode and steps up to MAX_SLOTS slots) in W8A8, rows quantized by
# quantize_act: row counts of one tile choice (64-row tiles: 4 experts x top-2, 33-64 rows)
experts = record(fused_moe, "_expert_gemm_kernel")
record(fused_moe, "_align_kernel"), record(fused_moe, "_slot_sum_kernel")
for rows in (40, 41, 48, 63):
    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(rows)])
    fused_moe.fused_experts(torch.randn(rows, H, dtype=torch.bfloat16), ids,
                            torch.rand(rows, TOP_K), w_up, w_down, (s_up, s_down),
                            fp8_act="w8a8")
# again with gate/up writing FP8 rows and their scales (QUANT_OUT), down reading them
base = fused_moe.gemm_config
fused_moe.gemm_config = lambda *a, gated=True, **kw: dict(
    base(*a, gated=gated, **kw), **({"BLOCK_N": 128, "QUANT_OUT": True} if gated else {}))
for rows in (40, 41, 48, 63):
    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(rows)])
    fused_moe.fused_experts(torch.randn(rows, H, dtype=torch.bfloat16), ids,
                            torch.rand(rows, TOP_K), w_up, w_down, (s_up, s_down),
                            fp8_act="w8a8")
fused_moe.gemm_config = base
assert len({c["BLOCK_M"] for c in experts.calls}) == 1
assert {c["stride_os_k"] > 0 for c in experts.calls[::2]} == {False, True}  # QUANT_OUT ran
bad["experts gate/up"] = experts.specialized_and_varying(2, 0)
bad["experts down"] = experts.specialized_and_varying(2, 1)

# paged decode attention (eager decode: graphs off, or batches past the captured ones) at
# split counts of one stage-2 tile (9-16 splits: BLOCK_S 16)
stage1 = record(paged_attention, "_paged_decode_stage1")
stage2 = record(paged_attention, "_paged_decode_stage2")
k = v = torch.zeros(64, 16, 4, 128, dtype=torch.bfloat16)
table, lens = torch.arange(64, dtype=torch.int32).view(4, 16), torch.full((4,), 200)
unit = paged_attention.unit_kv_scale(torch.device("cpu"))
for splits in (9, 12, 15, 16):  # the CUDA path itself (paged_decode_attention's, on CPU)
    paged_attention._paged_decode_triton(torch.randn(4, 32, 128, dtype=torch.bfloat16), k, v,
                                         table, lens, 0.1, splits, torch.bfloat16, None,
                                         False, unit)
assert len(stage2.calls) == 4
bad["decode attention stage 1"] = stage1.specialized_and_varying()
bad["decode attention stage 2"] = stage2.specialized_and_varying()
assert not any(bad.values()), f"specialized on the step's rows: {bad}"
print("rows never specialized")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_kernel_arguments_that_follow_the_rows_are_not_specialized() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rows never specialized" in out.stdout
