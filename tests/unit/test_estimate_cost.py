"""The cost terms of `cpmoe plan --estimate` on cases computed by hand here (the numbers in
each test are worked out in its comments, not by calling the code under test), and the
analytic weights and KV bytes per rank against `cpmoe plan`'s own count from shards built on
the meta device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpmoe.bench.spec import parse_config, read_shape
from cpmoe.engine.sizing import memory_per_rank
from cpmoe.estimate import cost
from cpmoe.estimate.rates import H200, Link, interpolate
from cpmoe.models.registry import model_class
from cpmoe.parallel.layout import ParallelLayout as P

# a toy model small enough to work out by hand
TOY = cost.ModelShape(layers=1, hidden=4, q_heads=2, kv_heads=2, head_dim=2, experts=4,
                      topk=2, moe_inter=3, dense_inter=0, dense_layers=0, shared_inter=0,
                      vocab=8, tied=False)
# round rates: every FLOP rate 1e3, link 100 bytes/s + 1 s, HBM 10 bytes/s + 2 s a kernel
ROUND = dataclasses.replace(
    H200, dense_gemm_flops=((1, 1e3),), grouped_gemm_flops=((1, 1e3),),
    attention_flops=((1, 1e3),),
    prefill_token_s=0.5, prefill_slot_s=0.25, prefill_fixed_s=0.0, prefill_host_token_s=0.0,
    hbm_bytes_per_s=10.0, read_fixed_s=2.0, decode_layer_fixed_s=7.0,
    all_gather=Link(100.0, 1.0), reduce_scatter=Link(100.0, 1.0), all_to_all=Link(100.0, 3.0),
    padded_a2a_efficiency=0.5)


def test_zigzag_blocks_match_the_split_rule():
    # L=10 over 2cp=4 blocks: the first 10 % 4 = 2 blocks get one more token: 3,3,2,2 at
    # starts 0,3,6,8; rank 0 keeps blocks 0 and 3, rank 1 blocks 1 and 2
    assert cost.zigzag_blocks(10, 2, 0) == [(0, 3), (8, 2)]
    assert cost.zigzag_blocks(10, 2, 1) == [(3, 3), (6, 2)]
    assert cost.zigzag_blocks(10, 1, 0) == [(0, 10)]


def test_zigzag_causal_flops_are_balanced_and_sum_to_the_whole():
    # L=16, cp=2, H=D=1: blocks of 4. Rank 0: (0,4),(12,4) -> 4*(0 + 8) + 4*(48 + 8) = 256;
    # rank 1: (4,4),(8,4) -> 4*(16 + 8) + 4*(32 + 8) = 256; one GPU 2*H*D*L^2 = 512
    assert cost.causal_flops(cost.zigzag_blocks(16, 2, 0), 1, 1) == 256
    assert cost.causal_flops(cost.zigzag_blocks(16, 2, 1), 1, 1) == 256
    assert cost.causal_flops([(0, 16)], 1, 1) == 512


def test_collectives():
    link = Link(100e9, 10e-6)
    # all-gather over 4 ranks of 1 MB each: 10 us + 3 MB / 100 GB/s = 40 us
    assert cost.all_gather_s(link, 4, 1e6) == pytest.approx(40e-6)
    assert cost.all_gather_s(link, 1, 1e6) == 0.0
    # all-reduce of 4 MB over 4 ranks: reduce-scatter + all-gather of 1 MB each, 80 us
    rates = dataclasses.replace(H200, all_gather=link, reduce_scatter=link)
    assert cost.all_reduce_s(rates, 4, 4e6) == pytest.approx(80e-6)
    # all-to-all, 1 MB leaving at half of 100 GB/s: 20 us + 20 us
    assert cost.all_to_all_s(Link(100e9, 20e-6), 2, 1e6, 0.5) == pytest.approx(40e-6)


def test_expert_counts_under_uniform_routing():
    assert cost.distinct_experts(1, 8, 128) == pytest.approx(8)
    # two rows: 128 * (1 - (120/128)^2) = 128 * 0.12109375 = 15.5
    assert cost.distinct_experts(2, 8, 128) == pytest.approx(15.5)
    # one other EP rank, top-1: reached half the time; top-2: 1 - 1/4
    assert cost.destinations(1, 2) == pytest.approx(0.5)
    assert cost.destinations(2, 2) == pytest.approx(0.75)


def test_attention_rate_interpolates_in_log_rows():
    points = ((100, 10.0), (10000, 30.0))
    assert interpolate(points, 50) == 10.0
    assert interpolate(points, 1000) == pytest.approx(20.0)  # half way in log10
    assert interpolate(points, 1e6) == 30.0


def test_prefill_layer_one_gpu_by_hand():
    t = cost.prefill_layer(TOY, P(), ROUND, length=8)
    # attention 2*H*D*L^2 = 2*2*2*64 = 512 FLOPs at 1e3
    assert t["attention"] == pytest.approx(0.512)
    # q/k/v + o: 2*8*4*((2+4)*2 + 2*2) = 1024, router 2*8*4*4 = 256
    assert t["dense_gemm"] == pytest.approx(1.280)
    # 16 slots x 2*3*4*3 = 72 FLOPs each
    assert t["expert_gemm"] == pytest.approx(1.152)
    assert t["elementwise"] == pytest.approx(8 * 0.5 + 16 * 0.25)
    assert t["kv_exchange"] == t["attn_tp_comm"] == t["moe_comm"] == 0.0


def test_prefill_layer_cp2_ep2_decoupled_by_hand():
    t = cost.prefill_layer(TOY, P(tp_size=2, attn_cp_size=2, ep_size=2), ROUND, length=8)
    # blocks of 2: rank 0 (0,2),(6,2): 4*2*2*(0+2) + 4*2*2*(12+2) = 32 + 224 = 256 FLOPs
    assert t["attention"] == pytest.approx(0.256)
    # K/V of 4 rows x 2 heads x 2 dims x 2 (K, V) x 2 bytes = 64 bytes: 1 s + 64 / 100
    assert t["kv_exchange"] == pytest.approx(1.64)
    # MOE_FULL: gather the 4 rows (4 x 4 x 2 = 32 bytes), reduce-scatter back to them
    assert t["moe_comm"] == pytest.approx(2 * (1 + 32 / 100))
    # all 8 rows routed on each rank, 8*2/2 = 8 slots on its two experts
    assert t["expert_gemm"] == pytest.approx(8 * 72 / 1e3)
    assert t["dense_gemm"] == pytest.approx((2 * 4 * 4 * 16 + 2 * 8 * 4 * 4) / 1e3)


def test_gemm_rates_are_read_at_rows_and_slots_per_expert():
    sized = dataclasses.replace(ROUND, dense_gemm_flops=((4, 2e3), (8, 4e3)),
                                grouped_gemm_flops=((1, 1e3), (4, 4e3)))
    one = cost.prefill_layer(TOY, P(), sized, length=8)
    # 8 rows: the 8-row dense rate; 16 slots over 4 experts = 4 an expert: the 4-slot rate
    assert one["dense_gemm"] == pytest.approx(1.280 / 4)
    assert one["expert_gemm"] == pytest.approx(1.152 / 4)
    two = cost.prefill_layer(TOY, P(tp_size=2, attn_cp_size=2, ep_size=2), sized, length=8)
    # 4 local rows (2e3); 8 slots over the rank's 2 experts, again 4 an expert
    assert two["dense_gemm"] == pytest.approx(0.768 / 2)
    assert two["expert_gemm"] == pytest.approx(0.576 / 4)


def test_prefill_layer_rank_local_dispatch_by_hand():
    lay = P(tp_size=2, attn_cp_size=2, ep_size=2, moe_a2a_backend="alltoall_padded")
    t = cost.prefill_layer(TOY, lay, ROUND, length=8)
    # 4 own rows, each reaching the other rank with p = 1 - (1/2)^2 = 0.75: 3 rows x 8
    # bytes = 24 bytes each way at half the bandwidth: 2 x (3 s + 24 / 50)
    assert t["moe_comm"] == pytest.approx(2 * (3 + 24 / 50))


def test_decode_layer_one_gpu_by_hand():
    t = cost.decode_layer(TOY, P(), ROUND, batch=1, context=8)
    # attention weights (4*(2+4)*2 + 2*2*4) * 2 bytes = 128 in two kernels; router 4*4*2 = 32
    assert t["weights_read"] == pytest.approx(2 * 2 + 128 / 10 + 2 + 32 / 10)
    # K/V: 8 tokens x 2 x 2 heads x 2 dims x 2 bytes = 128 bytes
    assert t["kv_read"] == pytest.approx(2 + 128 / 10)
    # one row touches 2 experts: 2 x 3*4*3 x 2 bytes = 144 bytes in two kernels
    assert t["experts_read"] == pytest.approx(2 * 2 + 144 / 10)
    assert t["small_kernels"] == 7.0
    assert t["attn_cp_comm"] == t["attn_tp_comm"] == t["moe_comm"] == 0.0


@pytest.mark.parametrize("shape", ["tiny", "qwen3-30b-a3b"])
def test_weights_and_kv_per_rank_match_plans_meta_shards(shape):
    cfg = parse_config(read_shape(shape, None)[1], shape)
    m = cost.ModelShape.from_config(cfg)
    for lay in (P(), P(tp_size=2, attn_cp_size=2, ep_size=2), P(tp_size=4, attn_cp_size=2),
                P(tp_size=4, attn_cp_size=4, moe_dp_size=4)):
        rank0 = memory_per_rank(cfg, model_class(cfg.architecture), lay, torch.bfloat16)[0]
        assert cost.weight_bytes(m, lay) == rank0["weight_bytes"], lay
        assert cost.kv_bytes_per_token(m, lay) == rank0["kv_bytes_per_token"], lay
