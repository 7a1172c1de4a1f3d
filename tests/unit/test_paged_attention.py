"""Paged decode attention (cpmoe.cp.paged_attention): the torch reference against a naive
float64 loop over each row's keys (taken from the dense per-row tensors the pool was filled
from, not through the block table), the Triton kernel against the reference in Triton's CPU
interpreter (a subprocess: TRITON_INTERPRET is read at import; skipped without Triton), and
the CP use: results over two disjoint KV shards merge into the result over all keys.

Pools are filled with NaN outside the rows' slots and block-table entries past a row's pages
are -1 or stale page ids, so any read of a slot that is not the row's shows up as NaN."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from cpmoe import ops
from cpmoe.cp import paged_attention as pa
from tests._interpreter import run_interpreted



def build_paged(lens: list[int], page: int, kv_heads: int, dim: int, dtype: torch.dtype,
                seed: int, spare_pages: int = 3):
    """-> (k_cache, v_cache, block_table_BP, kv_lens_B, rows_k, rows_v): row b's keys
    rows_k[b] [len, Hkv, D] written into shuffled pages of a NaN-filled pool."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page) for n in lens]
    num_pages = sum(n_pages) + spare_pages
    width = max(n_pages, default=0) + 1  # a column past every row's pages
    k_cache = torch.full((num_pages, page, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g)
    rows_k, rows_v, used = [], [], 0
    for b, (n, np_) in enumerate(zip(lens, n_pages)):
        ids = perm[used:used + np_]
        used += np_
        table[b, :np_] = ids.int()
        if b % 2:  # stale ids (other rows' or spare pages) past this row's pages
            table[b, np_:] = torch.randint(0, num_pages, (width - np_,), generator=g).int()
        k = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
        for t in range(n):
            k_cache[ids[t // page], t % page] = k[t]
            v_cache[ids[t // page], t % page] = v[t]
        rows_k.append(k)
        rows_v.append(v)
    lens_B = torch.tensor(lens, dtype=torch.int32)
    return k_cache, v_cache, table, lens_B, rows_k, rows_v


def naive_attention(q_BHD: torch.Tensor, rows_k: list[torch.Tensor], rows_v: list[torch.Tensor],
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention per row and head in float64 -> (o [B, H, D], lse [B, H])."""
    B, H, D = q_BHD.shape
    o = torch.zeros(B, H, D, dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        if rows_k[b].shape[0] == 0:
            continue
        group = H // rows_k[b].shape[1]
        for h in range(H):
            k = rows_k[b][:, h // group].double()
            v = rows_v[b][:, h // group].double()
            s = (k @ q_BHD[b, h].double()) * scale
            lse[b, h] = torch.logsumexp(s, dim=0)
            o[b, h] = torch.softmax(s, dim=0) @ v
    return o, lse


@pytest.mark.parametrize("page, dim", [(1, 16), (16, 32), (64, 80)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_reference_matches_naive_loop(page: int, dim: int, group: int) -> None:
    lens = [0, 1, page, page + 1, max(150, 3 * page + 5), 5]
    k_cache, v_cache, table, lens_B, rows_k, rows_v = build_paged(lens, page, 2, dim,
                                                                 torch.float32, seed=page + group)
    q = torch.randn(len(lens), 2 * group, dim)
    scale = dim ** -0.5
    o, lse = pa.paged_decode_attention_ref(q, k_cache, v_cache, table, lens_B, scale)
    want_o, want_lse = naive_attention(q, rows_k, rows_v, scale)
    assert o.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_public_entry_on_cpu_rounds_the_reference_once(dtype: torch.dtype) -> None:
    lens = [3, 0, 40]
    k_cache, v_cache, table, lens_B, rows_k, rows_v = build_paged(lens, 16, 2, 32, dtype, seed=7)
    q = torch.randn(3, 8, 32).to(dtype)
    o, lse = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, 0.2)
    want_o, want_lse = naive_attention(q, rows_k, rows_v, 0.2)
    assert o.dtype == dtype and lse.dtype == torch.float32
    ref_o, _ = pa.paged_decode_attention_ref(q, k_cache, v_cache, table, lens_B, 0.2)
    assert torch.equal(o, ref_o.to(dtype))
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    o32, _ = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, 0.2,
                                       out_dtype=torch.float32)
    torch.testing.assert_close(o32.double(), want_o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pools_attend_the_keys_they_hold(fmt: torch.dtype, dtype: torch.dtype) -> None:
    """--kv-cache-dtype fp8: the pools hold each row's keys rounded to FP8; attention (CPU
    path) is the naive float64 loop over those rounded keys, widened, o rounded once."""
    lens = [3, 0, 40, 17]
    k_cache, v_cache, table, lens_B, rows_k, rows_v = build_paged(lens, 16, 2, 32,
                                                                 torch.float32, seed=9)
    k8, v8 = k_cache.to(fmt), v_cache.to(fmt)  # NaN outside the rows' slots stays NaN
    q = torch.randn(len(lens), 8, 32).to(dtype)
    o, lse = pa.paged_decode_attention(q, k8, v8, table, lens_B, 0.2)
    want_o, want_lse = naive_attention(q, [k.to(fmt).float() for k in rows_k],
                                       [v.to(fmt).float() for v in rows_v], 0.2)
    assert o.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(o.double(), want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    unrounded, _ = naive_attention(q, rows_k, rows_v, 0.2)  # the rounding shows
    assert (unrounded - want_o).abs().max() > 10 * tol


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pools_attend_their_codes_times_the_layer_scales(fmt: torch.dtype) -> None:
    """A checkpoint's k_scale / v_scale (kv_scale [4]): attention reads each code times its
    scale; against the naive float64 loop over codes x scale. Scale 1 would differ."""
    lens = [3, 0, 40, 17]
    k_cache, v_cache, table, lens_B, rows_k, rows_v = build_paged(lens, 16, 2, 32,
                                                                 torch.float32, seed=4)
    k8, v8 = k_cache.to(fmt), v_cache.to(fmt)
    kv_scale = torch.empty(4)
    ops.fill_kv_scale(kv_scale, 0.37, 2.9)
    q = torch.randn(len(lens), 8, 32)
    o, lse = pa.paged_decode_attention(q, k8, v8, table, lens_B, 0.2, kv_scale=kv_scale)
    want_o, want_lse = naive_attention(q, [k.to(fmt).float() * 0.37 for k in rows_k],
                                       [v.to(fmt).float() * 2.9 for v in rows_v], 0.2)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    unscaled, _ = pa.paged_decode_attention(q, k8, v8, table, lens_B, 0.2)
    assert (unscaled.double() - want_o).abs().max() > 0.1
    with pytest.raises(ValueError, match="kv_scale must be float32 \\[4\\]"):
        pa.paged_decode_attention(q, k8, v8, table, lens_B, 0.2, kv_scale=kv_scale[:2])


def test_shards_merge_to_the_full_result() -> None:
    """The CP use: each rank holds some of a row's keys; merged partials equal the whole."""
    lens = [0, 1, 40, 77, 33]
    k_cache, v_cache, table, lens_B, rows_k, rows_v = build_paged(lens, 16, 2, 32,
                                                                 torch.float32, seed=3)
    q = torch.randn(len(lens), 8, 32)
    full_o, full_lse = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, 0.3)
    g = torch.Generator().manual_seed(4)
    owner = [torch.randint(0, 2, (n,), generator=g) for n in lens]
    owner[4].zero_()  # a row whose keys are all on shard 0: shard 1 has none (lse -inf)
    parts_o, parts_lse = [], []
    for shard in (0, 1):
        sub_lens = [int((o == shard).sum()) for o in owner]
        kc, vc, tb, lb, _, _ = build_paged(sub_lens, 16, 2, 32, torch.float32, seed=5)
        for b in range(len(lens)):  # refill the shard's pool with this row's own keys
            sel = owner[b] == shard
            for t, (k, v) in enumerate(zip(rows_k[b][sel], rows_v[b][sel])):
                kc[tb[b, t // 16], t % 16], vc[tb[b, t // 16], t % 16] = k, v
        o, lse = pa.paged_decode_attention(q, kc, vc, tb, lb, 0.3)
        parts_o.append(o)
        parts_lse.append(lse)
    merged = ops.merge_partials(torch.stack(parts_o), torch.stack(parts_lse))
    torch.testing.assert_close(merged, full_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.logsumexp(torch.stack(parts_lse), dim=0), full_lse,
                               rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_one_line_errors() -> None:
    k_cache, v_cache, table, lens_B, _, _ = build_paged([5, 9], 4, 2, 16, torch.float32, 0)
    q = torch.randn(2, 4, 16)
    cases = [
        ((q, k_cache, v_cache, table, lens_B.long()), "kv_lens must be int32"),
        ((q, k_cache, v_cache, table.long(), lens_B), "block_table must be int32"),
        ((torch.randn(2, 3, 16), k_cache, v_cache, table, lens_B), "H divisible by Hkv"),
        ((q.double(), k_cache, v_cache, table, lens_B), "must both be q's dtype or FP8"),
        ((q, k_cache, v_cache.to(torch.float8_e4m3fn), table, lens_B), "must both be"),
        ((q, k_cache, v_cache, table, torch.tensor([5, 99], dtype=torch.int32)),
         r"kv_lens must lie in \[0, 16\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            pa.paged_decode_attention(*args, scale=0.25)
        assert "\n" not in str(info.value)


def test_default_num_splits_follows_the_documented_rule() -> None:
    # H200 (132 SMs), Hkv 4: one wave of <= 4 programs per SM; large batches do not split
    assert pa.default_num_splits(16, 4, 32768 // 16, 16, 132) == 8
    assert pa.default_num_splits(64, 4, 1024 // 16, 16, 132) == 2
    assert pa.default_num_splits(128, 4, 1024 // 16, 16, 132) == 1
    assert pa.default_num_splits(256, 4, 1024 // 64, 64, 132) == 1
    assert pa.default_num_splits(1, 4, 1024 // 16, 16, 132) == 8  # >= 128 tokens a split
    assert pa.default_num_splits(1, 1, 1 << 20, 16, 132) == 64  # capped
    assert pa.default_num_splits(4, 4, 0, 16, 132) == 1
    # a tuned file's PROGRAMS_PER_SM in place of the 4: B = 64 at 8 an SM -> 4 splits
    assert pa.default_num_splits(64, 4, 1024 // 16, 16, 132, programs_per_sm=8) == 4
    assert pa.default_num_splits(128, 4, 1024 // 16, 16, 132, programs_per_sm=8) == 2


_KERNEL = r"""
import sys
import torch
from cpmoe import ops
from cpmoe.cp import paged_attention as pa
sys.path.insert(0, TEST_DIR)
from test_paged_attention import build_paged

assert ops.use_triton(torch.zeros(1)), "interpreter not active"
torch.manual_seed(0)
# error of one rounding to the dtype, relative. bf16: one ulp (2^-7), not half, because the
# interpreter (Triton 3.9) truncates fp32 -> bf16 where the GPU rounds to nearest
U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -11}


def check(lens, page, heads, kv_heads, dim, dtype, splits, out_dtype=None, views=False,
          workspace=False, pool=None, kv_scale=None, config=None):
    k_cache, v_cache, table, lens_B, _, _ = build_paged(lens, page, kv_heads, dim, dtype, 11)
    if pool is not None:  # --kv-cache-dtype fp8: the kernel widens what the pools hold
        k_cache, v_cache = k_cache.to(pool), v_cache.to(pool)
    if views:  # K and V as views of one [pages, page, 2, Hkv, D] pool (strided pages)
        kv = torch.stack([k_cache, v_cache], dim=2)
        k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    q = torch.randn(len(lens), heads, dim).to(dtype)
    scale = dim ** -0.5
    ws = None
    if workspace:
        ws = (torch.empty(len(lens), heads, splits, dim), torch.empty(len(lens), heads, splits))
    o, lse = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, scale,
                                       num_splits=splits, out_dtype=out_dtype, workspace=ws,
                                       kv_scale=kv_scale, config=config)
    want_o, want_lse = pa.paged_decode_attention_ref(q, k_cache, v_cache, table, lens_B, scale,
                                                     kv_scale)
    abs_o, _ = pa.paged_decode_attention_ref(q, k_cache, v_cache.abs(), table, lens_B, scale,
                                             kv_scale)
    # the kernel rounds p to the K/V dtype for the PV product and o once to out_dtype:
    # |o - ref| <= u_kv * attn(|v|) + u_out * |ref| (+ fp32 accumulation slack)
    u_out = U[out_dtype or dtype]
    bound = U[dtype] * abs_o + u_out * want_o.abs() + 1e-5
    err = (o.float() - want_o).abs()
    assert o.dtype == (out_dtype or dtype) and lse.dtype == torch.float32
    assert (err <= bound).all(), (lens, page, dtype, splits, (err - bound).max())
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    empty = lens_B == 0
    assert not o[empty].any() and torch.isneginf(lse[empty]).all()
    return q, k_cache, v_cache, table, lens_B, o, lse


# None picks 1 split here (stage 1 writes o directly). Splits are whole 64-key tiles, so the
# 150-key row fills 3 splits and 8 splits leave most of every row's splits empty
for splits in (None, 3, 8):
    check([0, 1, 16, 17, 150], 16, 8, 2, 32, torch.float32, splits)
check([5, 70, 0], 1, 3, 3, 80, torch.bfloat16, 3)  # page 1, GQA group 1, D not a power of 2
check([64, 65, 1], 64, 16, 2, 16, torch.float16, 2, out_dtype=torch.float32)  # group 8
check([33, 0, 47], 16, 4, 1, 64, torch.float32, 4, views=True, workspace=True)
check([130, 2], 16, 8, 2, 256, torch.bfloat16, 2)
# a stage-1 tile other than stage1_config's (a sweep's `config`): 16-key tiles, 3 stages
check([0, 1, 16, 17, 150], 16, 8, 2, 32, torch.float32, 3,
      config={"BLOCK_N": 16, "num_warps": 2, "num_stages": 3})
# the block table read PAGE_IDS entries at a time: 2 (several reads a split, 16-key tiles on
# 16-key pages: a tile a read), 4 (two 32-key tiles on 16-key pages a read) and 64 (one
# read); a page size the tile is not a multiple of (per tile instead); FP8 pools; against
# the same rows read per tile, bit for bit
for lens, page, cfg in (([0, 1, 16, 17, 150, 300], 16, {"BLOCK_N": 16, "PAGE_IDS": 2}),
                        ([0, 33, 150, 300], 16, {"BLOCK_N": 32, "PAGE_IDS": 4}),
                        ([5, 150, 300], 16, {"BLOCK_N": 64, "PAGE_IDS": 64}),
                        ([5, 150], 64, {"BLOCK_N": 32, "PAGE_IDS": 4})):
    for pool, splits in ((None, 1), (None, 3), (torch.float8_e4m3fn, 2)):
        torch.manual_seed(7)
        *_, o_ids, lse_ids = check(lens, page, 8, 2, 32, torch.bfloat16, splits, pool=pool,
                                   config=dict(cfg, num_warps=4, num_stages=3))
        torch.manual_seed(7)
        *_, o_tile, lse_tile = check(lens, page, 8, 2, 32, torch.bfloat16, splits, pool=pool,
                                     config=dict(cfg, PAGE_IDS=0, num_warps=4, num_stages=3))
        assert torch.equal(o_ids, o_tile) and torch.equal(lse_ids, lse_tile), (lens, cfg)
# the split count left to the launcher under a config's PROGRAMS_PER_SM (a tuned file's):
# with one SM, 2 rows x 2 KV heads make 2 splits at 8 programs an SM, 3 at 12, 1 at 4
pa._sm_count = lambda device: 1
rule, picked = pa.default_num_splits, []
pa.default_num_splits = lambda *a: picked.append(rule(*a)) or picked[-1]
for per_sm, splits in ((8, 2), (12, 3), (4, 1)):
    check([150, 600], 16, 8, 2, 32, torch.bfloat16, None,
          config={"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "PROGRAMS_PER_SM": per_sm})
    assert picked[-1] == splits, (per_sm, picked)
pa.default_num_splits = rule
try:  # a count that is not a power of two: refused in one line
    check([5], 16, 8, 2, 32, torch.bfloat16, 1, config={"BLOCK_N": 64, "PAGE_IDS": 48})
except ValueError as e:
    assert "PAGE_IDS (block-table entries read at a time) must be 0 or a power of two" in str(e)
else:
    raise AssertionError("PAGE_IDS 48 taken")
for pool in (torch.float8_e4m3fn, torch.float8_e5m2):  # FP8 pools, one and three splits
    check([0, 1, 16, 150], 16, 8, 2, 32, torch.bfloat16, 1, pool=pool)
    check([70, 5], 16, 8, 2, 32, torch.float32, 3, pool=pool)
    # a checkpoint's K/V scales, read by the kernel from the device (float32 q: the scaled
    # codes are products rounded once, as the reference's)
    kv_scale = torch.empty(4)
    ops.fill_kv_scale(kv_scale, 0.37, 2.9)
    torch.manual_seed(5)
    q, *_, o_scaled, _ = check([70, 5, 0], 16, 8, 2, 32, torch.float32, 3, pool=pool,
                               kv_scale=kv_scale)
    torch.manual_seed(5)
    q1, *_, o_unit, _ = check([70, 5, 0], 16, 8, 2, 32, torch.float32, 3, pool=pool)
    assert torch.equal(q, q1) and (o_scaled - o_unit).abs().max() > 0.1  # scales applied
# CP merge with the kernel: two shards of row keys merged equal the whole
q, kc, vc, tb, lb, o, lse = check([50, 20], 16, 8, 2, 32, torch.float32, 2)
tail = torch.tensor([30, 7], dtype=torch.int32)  # shard 1: keys [lb - tail, lb)
head = lb - tail
o0, l0 = pa.paged_decode_attention(q, kc, vc, tb, head, 32 ** -0.5, num_splits=3)
t_idx = head[:, None].long() + torch.arange(30)[None]
pages = torch.gather(tb.long(), 1, t_idx.clamp(max=tb.shape[1] * 16 - 1) // 16)
k_tail = kc[pages, t_idx % 16]  # [B, 30, Hkv, D]: the tail keys, repacked at page size 1
v_tail = vc[pages, t_idx % 16]
tb1 = torch.arange(2 * 30, dtype=torch.int32).view(2, 30)
o1, l1 = pa.paged_decode_attention(q, k_tail.reshape(60, 1, 2, 32), v_tail.reshape(60, 1, 2, 32),
                                   tb1, tail, 32 ** -0.5, num_splits=2)
merged = ops.merge_partials(torch.stack([o0, o1]), torch.stack([l0, l1]))
torch.testing.assert_close(merged, o, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(torch.logsumexp(torch.stack([l0, l1]), 0), lse, rtol=1e-5, atol=1e-5)

# quant_group == D: the last stage's output also in FP8, one group a head, offered to
# quantize_act (stage 2's, or stage 1's at one split, FP8 pools too); equal to
# quantize_act's own kernel on a copy (the same interpreter casts), o unchanged
from cpmoe.ops import fp8
for dtype in (torch.bfloat16, torch.float16):
    for pool in (dtype, torch.float8_e4m3fn):
        torch.manual_seed(6)
        kc, vc, tb, lb, _, _ = build_paged([40, 0, 90], 16, 2, 32, pool, 5)
        q = torch.randn(3, 4, 32).to(dtype)
        for splits in (1, 2):
            o, lse = pa.paged_decode_attention(q, kc, vc, tb, lb, 0.2, num_splits=splits,
                                               quant_group=32)
            offer = fp8.offered(o.view(3, 128), 32)
            o_plain, _ = pa.paged_decode_attention(q, kc, vc, tb, lb, 0.2, num_splits=splits)
            assert offer is not None and torch.equal(o, o_plain), splits
            q8, s8 = fp8.quantize_act(o.view(3, 128), 32)  # the offer
            assert q8 is offer[0] and s8 is offer[1]
            qu, su = fp8.quantize_act(o.view(3, 128).clone(), 32)
            assert q8 is not qu and s8.stride() == (1, 3) and torch.equal(s8, su), splits
            assert torch.equal(q8.view(torch.uint8), qu.view(torch.uint8)), (splits, pool)
            assert s8[1].eq(1e-12).all() and not q8[1].view(torch.uint8).any()  # no key
    # a group that is not D: nothing offered (o's offer stays)
    for splits in (1, 2):
        pa.paged_decode_attention(q, kc, vc, tb, lb, 0.2, num_splits=splits, quant_group=16)
        assert fp8.quantize_act(o.view(3, 128), 32)[0] is q8
print("paged kernel ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernel_matches_reference_in_the_interpreter() -> None:
    script = f"TEST_DIR = {str(pathlib.Path(__file__).parent)!r}\n" + _KERNEL
    out = run_interpreted(script, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "paged kernel ok" in out.stdout
