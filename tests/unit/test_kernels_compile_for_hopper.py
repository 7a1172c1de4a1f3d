"""The FP8 kernels' CUDA variants compile for the H200 (sm_90), without a GPU.

The interpreter tests run every kernel's arithmetic on CPU, but not Triton's CUDA compiler,
which refuses programs the interpreter runs (a jit function returning differently shaped
values from two constexpr branches did, in the SWAP_AB change tried at bec18aa on
2026-12-03). Here Triton compiles ahead of time, for an sm_90 target (ptxas ships with
Triton), the variants the engine launches: the decode experts' W8A8 GEMM (gate/up and down,
the grid of one program row per expert and the compact one of batch 1, and the variants
$CPMOE_DECODE_KERNELS_CONFIG may pick: two column tiles a program, gate/up's rows written in
FP8), the skinny dense GEMM with and without a split K, and the prefill's grouped GEMM;
decode attention's stage 1 keeps one tile's copies in flight only with its block table read
ahead (PAGE_IDS). Arguments carry the
16-byte alignment real launches specialize on, so the compiled program is the one a launch
gets: the tests check that its weight tiles are loaded through the asynchronous pipeline
(cp.async), and that the prefill GEMM uses Hopper's warp-group MMA, its tiles loaded by the
TMA unit where its config says so. Also the two kernels that quantize the rows they write
for the FP8 GEMM after them (the residual add + RMSNorm, decode attention's split merge),
and FP8 prefill attention's quantization kernels (q's in the norm + RoPE kernel). Every
kernel of a decode step is compiled as the H200 launches it, with programmatic dependent
launch (PDL): its first access to global memory must come after its wait for the kernel
before it (`griddepcontrol.wait`), else it could read rows that kernel has not written yet.
In a subprocess: cpmoe imports Triton only for a CUDA build of torch, which it is told it is.
"""

import importlib.util
import subprocess
import sys

import pytest

from tests._interpreter import REPO_ROOT

_SCRIPT = r"""
import inspect
import re
import unittest.mock

import torch
unittest.mock.patch.object(torch.version, "cuda", "13.0").start()  # Triton gets imported
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cpmoe.moe import fused_moe
from cpmoe.ops import fp8, fp8_gemm


def compile_sm90(fn, pointers, constexprs, unaligned, options):
    # pointers {name: Triton type}; other non-constexpr arguments int32, `limit` float32;
    # every argument not in `unaligned` 16-divisible, as launches specialize them
    params = list(inspect.signature(fn.fn).parameters)
    # constexpr parameters left out take their defaults (else they would compile as int32)
    constexprs = {p: v.default for p, v in inspect.signature(fn.fn).parameters.items()
                  if "constexpr" in str(v.annotation) and v.default is not inspect.Parameter.empty
                  } | constexprs
    sig = {p: "constexpr" if p in constexprs else pointers.get(
        p, "fp32" if p in ("limit", "eps", "scale_log2") else "i32") for p in params}
    aligned = [i for i, p in enumerate(params) if sig[p] != "constexpr" and p not in unaligned]
    src = ASTSource(fn, sig, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def launch_options(cfg):
    return {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}


def waits_first(ptx, name):
    # the kernel's first global load, store, atomic or asynchronous copy follows the wait
    wait = ptx.find("griddepcontrol.wait")
    first = re.search(r"\b(ld|st|atom|red)\.global|\bcp\.async\.", ptx)
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, name
    assert first is not None and wait < first.start(), (name, ptx[first.start() - 200:][:400])
    return ptx


E, H, I = 128, 2048, 768  # Qwen3-30B-A3B's experts
# batch 64 (down's weight tiles by TMA: gemm_config's choice), batch 1 (COMPACT); gate/up
# by TMA too, down by address; two column tiles a program, gate/up's rows written in FP8
# (the variants $CPMOE_DECODE_KERNELS_CONFIG may pick)
for slots, tma, more in ((512, None, {}), (8, None, {}), (512, True, {}), (512, False, {}),
                         (512, True, {"TILES": 2, "QUANT_OUT": True, "BLOCK_N": 128})):
    for gated, k_dim in ((True, H), (False, I)):
        cfg = fused_moe.gemm_config(slots, E, k_dim, True, "w8a8", gated=gated)
        cfg.update({k: v for k, v in more.items() if gated or k == "TILES"})
        if tma is None:
            assert cfg["TMA_W"] == (slots >= E and not gated), (slots, gated)
        else:
            cfg["TMA_W"] = tma
        by_tma = cfg["TMA_W"]
        options = launch_options(cfg)
        pieces = max(1, cfg["BLOCK_K"] // 128)
        w_type = f"tensordesc<fp8e4nv[{cfg['BLOCK_N']}, {cfg['BLOCK_K'] // pieces}]>"
        ptx = compile_sm90(
            fused_moe._expert_gemm_kernel,
            {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": w_type if by_tma else "*fp8e4nv",
             "s_ptr": "*fp32", "slots_ptr": "*i32", "counts_ptr": "*i32",
             "out_ptr": "*fp8e4nv" if cfg["QUANT_OUT"] else "*bf16", "os_ptr": "*fp32"},
            dict(cfg, GATED=gated, E_POW2=E, SCALED=True, UPCAST=False, CLAMP=False,
                 K_PIECES=pieces, PDL=True,
                 ROUND=triton.language.bfloat16 if cfg["QUANT_OUT"] else None),
            ("cap", "limit", "rows_per_a", "stride_as_k"), options)
        # rows by address (cp.async); weights by address or, TMA_W, by the TMA unit
        assert "cp.async" in ptx and ("cp.async.bulk.tensor" in ptx) == by_tma, (slots, gated)
        waits_first(ptx, ("experts", slots, gated, by_tma))
for m, n, k in ((64, 5120, 2048), (1, 2048, 4096), (16, 512, 128)):  # qkv, o_proj, no split
    cfg = fp8_gemm.skinny_config(m, n, k)
    options = launch_options(cfg)
    ptx = compile_sm90(
        fp8_gemm._skinny_fp8_kernel,
        {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
         "b_ptr": "*bf16", "part_ptr": "*fp32", "out_ptr": "*bf16", "count_ptr": "*i32"},
        dict(cfg, HAS_BIAS=True, BLOCK_M=max(16, m), UPCAST=False, PDL=True),
        ("M", "stride_xs_g"), options)
    assert "cp.async" in ptx, (m, n, k)
    waits_first(ptx, ("skinny", m))
    # split K: the count releases and acquires the partials, which are read from L2
    split = re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx) and "ld.global.cg" in ptx
    assert bool(split) == (cfg["SPLIT_K"] > 1), (m, n, k)
# the experts' gate/up (rows through a_rows, with its SwiGLU or without) and down GEMMs
# (after the SwiGLU gate/up, as the FP8 experts run it, or after the unfused one)
for a_rows, swiglu, after in ((True, True, False), (True, False, False), (False, False, True),
                              (False, False, False)):
    cfg = fp8_gemm.grouped_fp8_config(16384 * 8, E, a_rows=a_rows, swiglu=swiglu,
                                      after_swiglu=after)
    tma = cfg.pop("TMA")
    fp8_tile = "tensordesc<fp8e4nv[{}, 128]>"
    ptx = compile_sm90(
        fp8_gemm._grouped_fp8_kernel,
        {"a_ptr": fp8_tile.format(cfg["BM"]) if "a" in tma else "*fp8e4nv", "as_ptr": "*fp32",
         "w_ptr": fp8_tile.format(cfg["BN"]) if "w" in tma else "*fp8e4nv", "ws_ptr": "*fp32",
         "out_ptr": "*bf16", "offs_ptr": "*i64", "map_ptr": "*i32", "rows_ptr": "*i64"},
        {"E": E, "BN_Q": 128, "BM": cfg["BM"], "BN": cfg["BN"], "BK": 128, "UPCAST": False,
         "TMA_A": "a" in tma, "TMA_W": "w" in tma, "GATHER": a_rows, "SWIGLU": swiglu},
        ("P", "as_s0", "as_s1", "ws_s2"), launch_options(cfg))
    # tiles by the TMA unit (cp.async.bulk.tensor) or by addresses (cp.async), into wgmma
    assert "wgmma" in ptx and ("cp.async.bulk.tensor" in ptx) == bool(tma), (a_rows, tma)
    assert "cp.async.ca" in ptx or "cp.async.cg" in ptx or "a" in tma, a_rows
compile_sm90(fp8_gemm._tile_map_kernel, {"offs_ptr": "*i64", "map_ptr": "*i32"},
             {"E": E, "E_POW2": E, "BM": cfg["BM"], "BLOCK": 64}, ("slots",),
             {"num_warps": 4})
# the kernels that quantize the rows they write for the FP8 GEMM after them: decode's
# residual add + RMSNorm (Qwen3-30B-A3B's hidden) and attention's split merge (one head a
# group); both convert to e4m3 (cvt ... e4m3x2)
from cpmoe import ops
from cpmoe.cp import paged_attention
ptx = compile_sm90(
    ops.norm._add_rms_norm_kernel,
    {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
     "sum_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
    {"BLOCK": H, "QUANT": True, "GROUP": 128, "PDL": True}, ("n_rows",), {"num_warps": 4})
assert "e4m3x2" in waits_first(ptx, "add_rms_norm")
ptx = compile_sm90(
    paged_attention._paged_decode_stage2,
    {"op_ptr": "*fp32", "lp_ptr": "*fp32", "o_ptr": "*bf16", "lse_ptr": "*fp32",
     "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
    {"BLOCK_S": 2, "D_PAD": 128, "QUANT": True, "PDL": True}, ("B", "NUM_SPLITS"),
    {"num_warps": 4})
assert "e4m3x2" in waits_first(ptx, "stage 2")
# the rest of a decode step's kernels, at Qwen3-30B-A3B's sizes
from cpmoe.moe import fused_moe
bf16 = "*bf16"
for fn, pointers, constexprs, unaligned in (
        (paged_attention._paged_decode_stage1,
         {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "bt_ptr": "*i32", "lens_ptr": "*i32",
          "o_ptr": "*fp32", "lse_ptr": "*fp32", "kvs_ptr": "*fp32",
          "q8_ptr": "*fp8e4nv", "s8_ptr": "*fp32"},
         {"PAGE": 16, "BLOCK_N": 64, "G_PAD": 16, "D_PAD": 128, "IEEE": False,
          "UPCAST": False}, ("bt_sb", "NUM_SPLITS", "GROUP")),
        (ops.norm._qkv_norm_rope_store_kernel,
         {"qkv_ptr": bf16, "q_ptr": bf16, "qw_ptr": bf16, "kw_ptr": bf16, "cos_ptr": bf16,
          "sin_ptr": bf16, "k_cache_ptr": bf16, "v_cache_ptr": bf16, "slots_ptr": "*i64",
          "scale_ptr": "*fp32", "descale_ptr": "*fp32"},
         {"HAS_NORM": True, "HEADS": 32, "KV_HEADS": 4, "HALF": 64}, ("kv_heads",)),
        (ops.routing._softmax_topk_kernel, {"logits_ptr": bf16, "ids_ptr": "*i64", "w_ptr": bf16},
         {"K": 8, "RENORM": True, "BLOCK": 16, "E_POW2": E, "K_POW2": 8}, ("N",)),
        (fused_moe._align_kernel, {"ids_ptr": "*i64", "slots_ptr": "*i32", "counts_ptr": "*i32"},
         {"BLOCK_P": 512}, ("P", "cap")),
        (fused_moe._slot_sum_kernel,
         {"y_ptr": bf16, "ids_ptr": "*i64", "weight_ptr": bf16, "out_ptr": bf16},
         {"K": 8, "BLOCK": 1024}, ()),
        (fp8._quantize_act_kernel, {"x_ptr": bf16, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
         {"GROUP": 128, "BLOCK_M": 1}, ("M", "R")),
        ):
    ptx = compile_sm90(fn, pointers, dict(constexprs, PDL=True), unaligned, {"num_warps": 4})
    waits_first(ptx, fn.fn.__name__)
# FP8 K/V pools (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): decode attention loads the codes as
# int32 words and widens them to float16 (the layer's scales outside the dots); the store
# rounds to nearest and saturates (satfinite)


def stage1_words(cfg, e5m2, o_ptr, options, **constexprs):
    # decode attention's stage 1 on FP8 pools read as int32 words; o_ptr: float32 partials
    # (splits > 1) or the 16-bit output (one split)
    return compile_sm90(
        paged_attention._paged_decode_stage1,
        {"q_ptr": bf16, "k_ptr": "*i32", "v_ptr": "*i32", "bt_ptr": "*i32", "lens_ptr": "*i32",
         "o_ptr": o_ptr, "lse_ptr": "*fp32", "kvs_ptr": "*fp32", "q8_ptr": "*fp8e4nv",
         "s8_ptr": "*fp32"},
        dict(cfg, PAGE=16, G_PAD=16, D_PAD=128, IEEE=False, UPCAST=False, PDL=True,
             KV_FP8=True, KV_F16=True, WORDS=True, E5M2=e5m2, **constexprs),
        ("bt_sb", "NUM_SPLITS", "GROUP"), options)


for fmt, name in (("*fp8e4nv", "e4m3x2"), ("*fp8e5", "e5m2x2")):
    cfg = paged_attention.stage1_config(True, 128)
    options = launch_options(cfg)
    ptx = stage1_words(cfg, name == "e5m2x2", "*fp32", options)
    # four codes a word widened by cvt.rn.f16x2 (two a word), never read a byte at a time
    assert len(re.findall(r"cvt\.rn\.f16x2\." + name, waits_first(ptx, ("stage 1", fmt)))) >= 64
    assert not re.search(r"ld\.shared\.(u8|b8|s8)|ld\.global\.(u8|b8|s8)", ptx), fmt
    # each tile's block-table entries read inside the loop: every wait is for all copies
    # (no tile copied ahead of the one in use); read PAGE_IDS at a time before it, 3 stages
    # keep one tile's copies in flight while the one before is used
    for ids, stages in ((0, 3), (64, 3)):
        ptx = stage1_words(cfg, name == "e5m2x2", "*fp32",
                           {"num_warps": 4, "num_stages": stages}, PAGE_IDS=ids)
        ahead = {int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)} - {0}
        assert bool(ahead) == (ids > 0), (ids, ahead)
    # one split: stage 1 writes o_proj's FP8 rows itself (round to nearest, saturating)
    ptx = stage1_words(cfg, name == "e5m2x2", bf16, options, QUANT=True)
    quant = waits_first(ptx, ("stage 1 quant", fmt))
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", quant), fmt
    ptx = compile_sm90(
        ops.norm._qkv_norm_rope_store_kernel,
        {"qkv_ptr": bf16, "q_ptr": bf16, "qw_ptr": bf16, "kw_ptr": bf16, "cos_ptr": bf16,
         "sin_ptr": bf16, "k_cache_ptr": fmt, "v_cache_ptr": fmt, "slots_ptr": "*i64",
         "scale_ptr": "*fp32", "descale_ptr": "*fp32"},
        {"HAS_NORM": True, "HEADS": 32, "KV_HEADS": 4, "HALF": 64, "PDL": True,
         "KV_MAX": 448.0 if name == "e4m3x2" else 57344.0}, ("kv_heads",), {"num_warps": 4})
    assert re.search(r"cvt\.rn\.satfinite\." + name, waits_first(ptx, ("store", fmt))), fmt
# a served chunk's q in e4m3 for FP8 prefill attention (ops.qkv_norm_rope_store_fp8), over
# e4m3 pools: the scale an IEEE division
ptx = compile_sm90(
    ops.norm._qkv_norm_rope_store_kernel,
    {"qkv_ptr": bf16, "q_ptr": "*fp8e4nv", "qw_ptr": bf16, "kw_ptr": bf16, "cos_ptr": bf16,
     "sin_ptr": bf16, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
     "slots_ptr": "*i64", "scale_ptr": "*fp32", "descale_ptr": "*fp32"},
    {"HAS_NORM": True, "HEADS": 32, "KV_HEADS": 4, "HALF": 64, "PDL": True, "KV_MAX": 448.0,
     "FP8_Q": True, "SQRT_D": 128 ** 0.5}, ("kv_heads",), {"num_warps": 4})
assert "div.rn.f32" in waits_first(ptx, "store, e4m3 q")
# FP8 prefill attention's quantization (cp.fp8_attention): the amax an atomic maximum, the
# codes rounded to nearest and saturated, the scale an IEEE division; O widened to bf16;
# every access 8 or 16 bytes wide (vectorized: masks on whole rows only)
from cpmoe.cp import fp8_attention as fa
block_r, block_c = fa._tile(32 * 128)
block = {"BLOCK_R": block_r, "BLOCK_C": block_c}
wide = (lambda ptx, op: re.search(op + r"\.global(\.[a-z0-9_]+)*\.v[24]\.", ptx)
        and not re.search(op + r"\.global(\.[a-z0-9_]+)*\.(u8|b8|b16|u16) ", ptx))
ptx = compile_sm90(fa._amax_kernel, {"x_ptr": bf16, "amax_ptr": "*fp32"}, block, ("n",),
                   {"num_warps": 8})
assert re.search(r"\batom\.global\.[a-z0-9._]*max", ptx) and wide(ptx, "ld")
ptx = compile_sm90(fa._scale_cast_kernel, {"x_ptr": bf16, "out_ptr": "*fp8e4nv",
                                           "amax_ptr": "*fp32", "descale_ptr": "*fp32"},
                   block, ("n", "total"), {"num_warps": 8})
assert re.search(r"cvt\.rn\.satfinite\.e4m3x2", ptx) and "div.rn.f32" in ptx
assert wide(ptx, "ld") and wide(ptx, "st")
ptx = compile_sm90(fa._dequant_kernel, {"x_ptr": "*fp8e4nv", "out_ptr": bf16,
                                        "descale_ptr": "*fp32"}, block, ("n",),
                   {"num_warps": 8})
assert re.search(r"cvt\.rn\.bf16", ptx) and wide(ptx, "ld") and wide(ptx, "st")
# q's norm + RoPE writing e4m3 for FP8 attention (ops.norm_rope_fp8): the scale an IEEE
# division, the codes rounded to nearest and saturated
ptx = compile_sm90(ops.norm._norm_rope_kernel,
                   {"x_ptr": bf16, "out_ptr": "*fp8e4nv", "w_ptr": bf16, "cos_ptr": bf16,
                    "sin_ptr": bf16, "descale_ptr": "*fp32"},
                   {"HAS_NORM": True, "HEADS": 32, "HALF": 64, "FP8_OUT": True,
                    "SQRT_D": 128 ** 0.5}, (), {"num_warps": 4})
assert re.search(r"cvt\.rn\.satfinite\.e4m3x2", ptx) and "div.rn.f32" in ptx
print("compiled")
"""


def _nvidia_backend() -> bool:
    try:
        return importlib.util.find_spec("triton.backends.nvidia") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend not installed")
def test_fp8_gemm_kernels_compile_for_sm90() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
