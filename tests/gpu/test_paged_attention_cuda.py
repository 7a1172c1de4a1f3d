"""The paged decode-attention Triton kernel on CUDA against the float32 torch reference, its
CUDA-graph replay against eager calls, and (printed with `-s`, never asserted) the HBM
bandwidth it reaches. Skipped without a GPU; run on the GPU machine:
`python3 -m pytest tests/gpu/test_paged_attention_cuda.py -q -s`.

Tolerance, from bf16 rounding (u = 2^-8, round to nearest): the kernel's q.k products of bf16
values are exact in fp32 and accumulate in fp32, so scores (and lse) carry only fp32 error;
two roundings reach o: each probability p_t is rounded to bf16 for the P.V tensor-core product
(error <= u * sum_t p_t |v_t| / sum_t p_t = u * attn(|v|)), and o is rounded once to bf16
(<= u * |o|). So |o - ref| <= u * (attn(|v|) + |ref|) + fp32 slack (1e-5 * attn(|v|) + 1e-6),
elementwise, with attn(|v|) computed by the reference on |v|. lse: |d lse| <= max_t |d s_t|,
and an fp32 dot of D products is off by <= D * 2^-24 * scale * sum_d |q_d k_d| <=
D * 2^-24 * scale * |q| |k| (largest norms); twice that (exp2/log2 approximations, the fp32
sums) is the lse tolerance, about 3e-4 for D = 128 and these N(0, 1) inputs. Seen on an
H200: o within 0.59 of its bound, lse within 1.5e-6; a kernel that drops one split in stage
2 fails every multi-split case.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.cp import paged_attention as pa

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

H, HKV, D = 32, 4, 128  # Qwen3-30B-A3B's attention on one rank
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


# the fp32 reference must not run in TF32 (tests/gpu/conftest.py)
pytestmark = pytest.mark.usefixtures("exact_fp32_matmul")


def make_batch(lens: list[int], page: int, dtype: torch.dtype = torch.bfloat16,
               heads: int = H, kv_heads: int = HKV, dim: int = D, seed: int = 0):
    """Random pool; row b owns ceil(len_b / page) shuffled pages (+ one spare -1 column)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = [-(-n // page) for n in lens]
    num_pages = sum(n_pages) + 1
    width = max(n_pages) + 1
    k_cache = torch.randn(num_pages, page, kv_heads, dim, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page, kv_heads, dim, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(num_pages, device="cuda", generator=g).int()
    table = torch.full((len(lens), width), -1, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[start:start + n]
        start += n
    q = torch.randn(len(lens), heads, dim, device="cuda", generator=g).to(dtype)
    lens_B = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, lens_B


def check_against_reference(q, k_cache, v_cache, table, lens_B, num_splits=None) -> None:
    dtype, scale = q.dtype, q.shape[-1] ** -0.5
    o, lse = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, scale, num_splits)
    want_o, want_lse = pa.paged_decode_attention_ref(q, k_cache, v_cache, table, lens_B, scale)
    abs_o, _ = pa.paged_decode_attention_ref(q, k_cache, v_cache.float().abs(), table, lens_B,
                                             scale)
    bound = U[dtype] * (abs_o + want_o.abs()) + 1e-5 * abs_o + 1e-6
    err = (o.float() - want_o).abs()
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert (err <= bound).all(), f"o off by {(err - bound).max().item():.3g} past the bound"
    norms = q.float().norm(dim=-1).max() * k_cache.float().norm(dim=-1).max()
    lse_tol = 2 * q.shape[-1] * 2.0 ** -24 * scale * norms.item() + 1e-6
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=lse_tol)
    empty = lens_B == 0
    assert not o[empty].any() and torch.isneginf(lse[empty]).all()


def ragged_lens(batch: int, ctx: int, seed: int) -> list[int]:
    """Row 0 full, row 1 empty (a padded graph slot), the rest uniform in [1, ctx]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, ctx + 1, (batch,), generator=g).tolist()
    lens[0] = ctx
    if batch > 1:
        lens[1] = 0
    return lens


@cuda
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("batch, ctx", [(1, 1024), (16, 1024), (64, 1024), (256, 1024),
                                        (16, 32768)])
def test_bf16_kernel_matches_fp32_reference(batch: int, ctx: int, page: int) -> None:
    lens = ragged_lens(batch, ctx, seed=batch + page)
    check_against_reference(*make_batch(lens, page, seed=batch * page))


@cuda
@pytest.mark.parametrize("dtype, dim, page, splits", [
    (torch.float32, 128, 16, None), (torch.float16, 64, 16, 5), (torch.bfloat16, 80, 16, 3),
    (torch.bfloat16, 256, 64, None), (torch.bfloat16, 128, 1, 7), (torch.bfloat16, 96, 16, 1)])
def test_other_dtypes_dims_and_splits_match_reference(dtype, dim, page, splits) -> None:
    lens = ragged_lens(8, 2000, seed=dim)
    batch = make_batch(lens, page, dtype=dtype, heads=16, kv_heads=2, dim=dim, seed=dim)
    check_against_reference(*batch, num_splits=splits)


@cuda
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("batch, ctx, splits", [(64, 1024, None), (16, 4096, None),
                                                (8, 2000, 3)])
def test_fp8_pools_match_reference_on_the_values_they_hold(fmt, batch, ctx, splits) -> None:
    """--kv-cache-dtype fp8: the kernel widens the pools' values to bf16 exactly as it loads
    them, so the bf16 bound above holds against the reference on the same FP8 values."""
    q, k_cache, v_cache, table, lens_B = make_batch(ragged_lens(batch, ctx, seed=ctx), 16,
                                                    seed=batch)
    check_against_reference(q, k_cache.to(fmt), v_cache.to(fmt), table, lens_B, splits)


@cuda
def test_cuda_graph_replay_matches_eager_with_new_lengths_and_tables() -> None:
    batch, ctx, page = 16, 4096, 16
    q, k_cache, v_cache, table, lens_B = make_batch([ctx] * batch, page, seed=1)
    lens_B.fill_(1)  # captured with 1 key per row: replays must not depend on it
    scale = D ** -0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up off the capture
        pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, lse_graph = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, scale)
    g = torch.Generator(device="cuda").manual_seed(2)
    for trial in range(3):
        lens_B.copy_(torch.randint(0, ctx + 1, (batch,), device="cuda", generator=g))
        lens_B[trial] = 0
        shuffled = table[torch.randperm(batch, device="cuda", generator=g)]
        table.copy_(shuffled)
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        graph.replay()
        o, lse = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, scale)
        assert torch.equal(o_graph, o) and torch.equal(lse_graph, lse), trial
        check_against_reference(q, k_cache, v_cache, table, lens_B)


@cuda
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("batch, ctx", [(64, 1024), (16, 32768)])
def test_print_achieved_hbm_bandwidth(batch: int, ctx: int, page: int) -> None:
    """Not an assertion on speed: prints K/V bytes read / time, kernels replayed in a graph
    (so launch overhead is out) over a pool several times the L2."""
    q, k_cache, v_cache, table, lens_B = make_batch([ctx] * batch, page, seed=3)
    scale, calls = D ** -0.5, 20
    o, _ = pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            pa.paged_decode_attention(q, k_cache, v_cache, table, lens_B, scale)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / (5 * calls)
    kv_bytes = 2 * batch * ctx * HKV * D * k_cache.element_size()
    splits = pa.default_num_splits(batch, HKV, table.shape[1], page, pa._sm_count(q.device))
    print(f"\npaged decode B={batch} ctx={ctx} page={page} H={H} Hkv={HKV} D={D} "
          f"splits={splits}: {seconds * 1e6:.1f} us, {kv_bytes / seconds / 1e12:.2f} TB/s "
          f"({kv_bytes / 1e6:.0f} MB of K/V)")
    assert torch.isfinite(o).all()
