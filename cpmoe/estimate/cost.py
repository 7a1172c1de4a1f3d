"""Cost terms of one decoder layer per rank, for a layout: prefill (one step over whole
prompts) and decode (one step of a batch); times in seconds, from `Rates`.

Each term is the time of the busiest rank (zigzag balances causal attention exactly, so
ranks differ only by the EP imbalance of the router, `imbalance` = busiest EP rank's slots /
the mean). cpmoe runs its collectives synchronously (the overlap measured slower,
BENCHMARKS.md), so a layer's time is the sum of its terms, not the max.

FLOPs (2 per multiply-add): causal attention of n query rows after s earlier keys is
4*H*D*(n*s + n^2/2) (QK^T and PV), which sums to 2*H*D*L^2 over a prompt; a GEMM of m rows
is 2*m*k*n. Collectives over n ranks on one link (nccl-tests' bus-bandwidth convention):
    all_gather      latency + (n-1) * bytes_per_rank / bw
    reduce_scatter  latency + (n-1) * bytes_out_per_rank / bw
    all_reduce      a reduce_scatter then an all_gather of bytes / n each
    all_to_all      latency + bytes that leave the rank / bw
and 0 for a group of one rank. A decode kernel that streams `b` bytes takes
read_fixed_s + b / hbm_bytes_per_s.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpmoe.estimate.rates import Link, Rates
from cpmoe.models.qwen_moe.config import QwenMoeConfig
from cpmoe.parallel.layout import ParallelLayout

BF16 = 2  # bytes of an activation or a weight
FP32 = 4


class EstimateError(ValueError):
    """A model or layout the cost model cannot estimate; one line."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    experts: int
    topk: int
    moe_inter: int
    dense_inter: int
    dense_layers: int  # layers with a dense MLP instead of experts
    shared_inter: int
    vocab: int
    tied: bool
    qk_norm: bool = True
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        if not isinstance(cfg, QwenMoeConfig):
            raise EstimateError(f"--estimate models Qwen-MoE checkpoints only; "
                                f"{cfg.architecture} is not one (its attention differs)")
        dense = sum(not cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.num_experts,
                   cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size,
                   dense, cfg.shared_expert_intermediate_size or 0, cfg.vocab_size,
                   bool(cfg.tie_word_embeddings), bool(cfg.qk_norm), bool(cfg.qkv_bias))


# ---- elementary terms ------------------------------------------------------------------

def zigzag_blocks(length: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """(start, rows) of the two query blocks of `cp_rank` (one block when cp == 1)."""
    if cp == 1:
        return [(0, length)]
    sizes = [length // (2 * cp) + (1 if b < length % (2 * cp) else 0) for b in range(2 * cp)]
    starts = [sum(sizes[:b]) for b in range(2 * cp)]
    return [(starts[b], sizes[b]) for b in (cp_rank, 2 * cp - 1 - cp_rank)]


def causal_flops(blocks: list[tuple[int, int]], heads: int, head_dim: int) -> float:
    return sum(4.0 * heads * head_dim * (n * s + n * n / 2) for s, n in blocks)


def all_gather_s(link: Link, n: int, bytes_per_rank: float) -> float:
    return 0.0 if n == 1 else link.latency_s + (n - 1) * bytes_per_rank / link.bus_bytes_per_s


def reduce_scatter_s(link: Link, n: int, bytes_out_per_rank: float) -> float:
    return all_gather_s(link, n, bytes_out_per_rank)  # the same ring, the other way


def all_reduce_s(rates: Rates, n: int, nbytes: float) -> float:
    if n == 1:
        return 0.0
    return reduce_scatter_s(rates.reduce_scatter, n, nbytes / n) + \
        all_gather_s(rates.all_gather, n, nbytes / n)


def all_to_all_s(link: Link, n: int, remote_bytes: float, efficiency: float = 1.0) -> float:
    return 0.0 if n == 1 else link.latency_s + remote_bytes / (link.bus_bytes_per_s * efficiency)


def read_s(rates: Rates, nbytes: float, kernels: int = 1) -> float:
    return kernels * rates.read_fixed_s + nbytes / rates.hbm_bytes_per_s


def distinct_experts(rows: float, topk: int, experts: int) -> float:
    """Experts a batch of `rows` touches under uniform routing: E (1 - (1 - k/E)^rows)."""
    return experts * (1.0 - (1.0 - topk / experts) ** rows)


def destinations(topk: int, ep: int) -> float:
    """Other EP ranks one token's top-k reaches (uniform routing, many experts a rank)."""
    return (ep - 1) * (1.0 - (1.0 - 1.0 / ep) ** topk)


# ---- per-rank sizes of a layout --------------------------------------------------------

@dataclass(frozen=True)
class RankShape:
    """What one rank holds of every layer."""

    q_heads: int
    kv_heads: int  # KV heads fewer than attention TP are replicated: at least one a rank
    experts: int  # local experts
    moe_inter: int  # each local expert's intermediate width (MoE TP shards it)

    @classmethod
    def of(cls, m: ModelShape, layout: ParallelLayout) -> RankShape:
        atp = layout.attn_tp_size
        return cls(m.q_heads // atp, max(1, m.kv_heads // atp), m.experts // layout.ep_size,
                   m.moe_inter // layout.moe_tp_size)


def weight_bytes(m: ModelShape, layout: ParallelLayout) -> int:
    """bf16 weights of one rank: embedding and LM head replicated, attention over attention
    TP, experts over EP x MoE TP, routers and norms replicated."""
    r = RankShape.of(m, layout)
    atp = layout.attn_tp_size
    D, H = m.head_dim, m.hidden
    attn = H * (r.q_heads + 2 * r.kv_heads) * D + r.q_heads * D * H + 2 * H
    attn += 2 * D if m.qk_norm else 0
    attn += (r.q_heads + 2 * r.kv_heads) * D if m.qkv_bias else 0
    sparse = m.experts * H + r.experts * 3 * H * r.moe_inter
    if m.shared_inter:
        sparse += 3 * H * m.shared_inter // atp + H
    dense = 3 * H * m.dense_inter // atp
    sparse_layers = m.layers - m.dense_layers
    params = (m.vocab * H * (1 if m.tied else 2) + H + m.layers * attn
              + sparse_layers * sparse + m.dense_layers * dense)
    return params * BF16


def kv_bytes_per_token(m: ModelShape, layout: ParallelLayout) -> int:
    """K and V of one stored token on one rank, every layer (bf16 pools)."""
    return 2 * m.layers * RankShape.of(m, layout).kv_heads * m.head_dim * BF16


def prefill_activation_bytes(m: ModelShape, layout: ParallelLayout, tokens: int,
                             imbalance: float) -> float:
    """A rough peak of one prefill layer's transient tensors on the busiest rank: the MoE's
    input and output rows, each slot's gathered row and gate/up output, the gathered K/V and
    the local queries and attention output."""
    r = RankShape.of(m, layout)
    local = tokens / layout.attn_cp_size
    rows, slots = moe_rows_slots(m, layout, local, tokens, imbalance)
    kv = tokens * 2 * r.kv_heads * m.head_dim
    return BF16 * (rows * 2 * m.hidden + slots * (m.hidden + 2 * r.moe_inter) + kv
                   + local * 2 * r.q_heads * m.head_dim)


def moe_rows_slots(m: ModelShape, layout: ParallelLayout, local: float, tokens: float,
                   imbalance: float) -> tuple[float, float]:
    """Prefill rows the MoE of one rank routes and (row, expert) slots its experts compute:
    FULL routes the CP chunk, MOE_FULL every chunk of the prompt, SCATTERED the chunk's
    share of attention TP; the slots are the routed rows' top-k over the EP ranks."""
    if layout.rank_local_dispatch:
        rows = local / layout.attn_tp_size
        return rows, tokens * m.topk / layout.ep_size * imbalance
    rows = tokens if layout.decoupled else local
    return rows, rows * m.topk / layout.ep_size * imbalance


# ---- prefill and decode terms of one layer ----------------------------------------------

def prefill_layer(m: ModelShape, layout: ParallelLayout, rates: Rates, length: int,
                  batch: int = 1, imbalance: float = 1.0, sparse: bool = True
                  ) -> dict[str, float]:
    """Seconds of one layer on the busiest rank, `batch` prompts of `length` tokens; a
    dense layer's MLP is sharded over attention TP and all-reduced there."""
    r = RankShape.of(m, layout)
    cp, atp, D, H = layout.attn_cp_size, layout.attn_tp_size, m.head_dim, m.hidden
    tokens = batch * length
    local = tokens / cp
    flops = batch * max(causal_flops(zigzag_blocks(length, cp, k), r.q_heads, D)
                        for k in range(cp))
    proj = 2.0 * local * H * ((r.q_heads + 2 * r.kv_heads) * D + r.q_heads * D)
    if sparse:
        rows, slots = moe_rows_slots(m, layout, local, tokens, imbalance)
        proj += 2.0 * rows * H * m.experts  # the router
        proj += 2.0 * local * 3 * H * m.shared_inter / atp  # shared experts, CP-local rows
        moe_comm = _prefill_moe_comm(m, layout, rates, local, tokens)
        mlp_comm = 0.0
    else:
        slots, moe_comm = 0.0, 0.0
        proj += 2.0 * local * 3 * H * m.dense_inter / atp
        mlp_comm = all_reduce_s(rates, atp, local * H * BF16)
    kv_row = 2 * r.kv_heads * D * BF16
    return {
        "attention": flops / rates.attention_rate(local),
        "dense_gemm": proj / rates.dense_rate(local),
        "expert_gemm": (2.0 * slots * 3 * H * r.moe_inter
                        / rates.grouped_rate(max(1.0, slots / r.experts))),
        "elementwise": local * rates.prefill_token_s + slots * rates.prefill_slot_s,
        "kv_exchange": all_gather_s(rates.all_gather, cp, local * kv_row),
        "attn_tp_comm": all_reduce_s(rates, atp, local * H * BF16) + mlp_comm,
        "moe_comm": moe_comm,
    }


def _prefill_moe_comm(m: ModelShape, layout: ParallelLayout, rates: Rates, local: float,
                      tokens: float) -> float:
    H, cp, atp = m.hidden, layout.attn_cp_size, layout.attn_tp_size
    if layout.rank_local_dispatch:
        rows = local / atp
        remote = rows * destinations(m.topk, layout.ep_size) * H * BF16
        eff = rates.padded_a2a_efficiency if layout.moe_a2a_backend == "alltoall_padded" else 1.0
        a2a = 2 * all_to_all_s(rates.all_to_all, layout.ep_size, remote, eff)
        return a2a + all_gather_s(rates.all_gather, atp, rows * H * BF16)
    group = layout.moe_group_size
    if not layout.decoupled:
        return all_reduce_s(rates, group, local * H * BF16)
    gather = all_gather_s(rates.all_gather, cp, local * H * BF16)
    if atp == 1 and group == cp:  # the expert shards are the CP ranks: a reduce-scatter
        return gather + reduce_scatter_s(rates.reduce_scatter, cp, local * H * BF16)
    return gather + all_reduce_s(rates, group, tokens * H * BF16)


def decode_layer(m: ModelShape, layout: ParallelLayout, rates: Rates, batch: int,
                 context: int) -> dict[str, float]:
    """Seconds of one sparse decode layer on one rank, `batch` sequences of `context`
    cached tokens each (KV sharded over CP), under CUDA graphs."""
    r = RankShape.of(m, layout)
    cp, atp, ep, D, H = (layout.attn_cp_size, layout.attn_tp_size, layout.ep_size,
                         m.head_dim, m.hidden)
    attn_w = (H * (r.q_heads + 2 * r.kv_heads) * D + r.q_heads * D * H) * BF16
    kv = batch * context / cp * 2 * r.kv_heads * D * BF16
    if layout.rank_local_dispatch:  # rows split over every rank, experts see the whole batch
        rows, routed = -(-batch // layout.world_size), batch
    elif layout.decoupled:  # MOE_FULL: every rank all rows, its shard of the experts
        rows, routed = batch, batch
    else:  # FULL: rows split over CP (the busiest rank has the rounded-up share)
        rows = routed = -(-batch // cp)
    touched = distinct_experts(routed, m.topk, m.experts) / ep
    expert_b = touched * 3 * H * r.moe_inter * BF16
    terms = {
        "weights_read": read_s(rates, attn_w, kernels=2) + read_s(rates, m.experts * H * BF16),
        "kv_read": read_s(rates, kv),
        "experts_read": read_s(rates, expert_b, kernels=2),
        "small_kernels": rates.decode_layer_fixed_s,
        "attn_cp_comm": all_gather_s(rates.all_gather, cp,
                                     batch * (r.q_heads * D + r.q_heads) * FP32),
        "attn_tp_comm": all_reduce_s(rates, atp, batch * H * BF16),
        "moe_comm": _decode_moe_comm(m, layout, rates, rows),
    }
    return terms


def _decode_moe_comm(m: ModelShape, layout: ParallelLayout, rates: Rates, rows: float) -> float:
    H, cp = m.hidden, layout.attn_cp_size
    if layout.rank_local_dispatch:
        remote = rows * destinations(m.topk, layout.ep_size) * H * BF16
        eff = rates.padded_a2a_efficiency if layout.moe_a2a_backend == "alltoall_padded" else 1.0
        return (2 * all_to_all_s(rates.all_to_all, layout.ep_size, remote, eff)
                + all_gather_s(rates.all_gather, layout.world_size, rows * H * BF16))
    out = all_reduce_s(rates, layout.moe_group_size, rows * H * BF16)
    if not layout.decoupled and cp > 1:  # the CP ranks' rows back to every rank
        out += all_gather_s(rates.all_gather, cp, rows * H * BF16)
    return out


def prefill_fixed_s(rates: Rates, tokens: int) -> float:
    return rates.prefill_fixed_s + tokens * rates.prefill_host_token_s


def lm_head_read_s(m: ModelShape, rates: Rates) -> float:
    return read_s(rates, m.vocab * m.hidden * BF16)
