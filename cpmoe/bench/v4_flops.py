"""Model FLOPs of a DeepSeek-V4 prefill (the MFU numerator of `cpmoe bench` V4 rows).

Counted: every matrix product of the model's math at 2 FLOPs per multiply-add, over the
work the model *needs* (causally visible keys only, the indexer's chosen entries only),
not what an implementation spends on masked or padded entries. Left out: elementwise ops,
norms, softmaxes, RoPE, the Sinkhorn iterations and the hyper-connection stream collapses
(O(hc*H) per token each), the embedding and the LM head (bench computes last-token logits).

Per token and layer (H hidden, Hq heads of D, q_lora, o_lora, g o_groups, hc streams,
E experts top-k of width I, CSA rate m_c with index_n_heads nI of dI and top-k Ki, HCA rate
m_h, W sliding window):

    hyper-connections  2 x [2*(hc*H)*((2+hc)*hc)  +  2*hc*hc*H]      (attn_hc and ffn_hc:
                       mixing projection, stream mix comb^T h)
    attention proj.    2*H*q_lora + 2*q_lora*Hq*D + 2*H*D + 2*Hq*D*o_lora + 2*g*o_lora*H
    compressor (CSA/HCA, width F = 2D on CSA, D on HCA)
                       2*2*H*F (kv and gate projections) + 2*F (softmax-weighted pooling)
    indexer (CSA)      2*2*H*(2*dI) + 2*(2*dI) (its compressor) + 2*q_lora*nI*dI
                       (queries) + 2*H*nI (head weights)
    MoE                2*H*E (router, hash layers too) + 6*k*H*I (routed) + 6*H*I (shared)

and the hyper head once per token: 2*(hc*H)*hc. Per query at position p (0-based), with
r(p) = (p+1) // m entries whose window has closed:

    sliding window     4*Hq*D*min(p+1, W)                (QK^T and PV over shared K = V)
    HCA                4*Hq*D*r(p)
    CSA                4*Hq*D*min(Ki, r(p))  +  (2*nI*dI + 2*nI)*r(p)   (attention over the
                       indexer's picks; indexer scores q.k per head and the head-weighted sum)

Sums over p have closed forms (`_window_keys`, `_closed_entries`); tests check the whole
count against torch's FLOP counter plus a per-query brute force.
"""

from __future__ import annotations

from cpmoe.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config

V4_FLOPS_FORMULA = (
    "DeepSeek-V4 model_flops = sum over layers of per-token matmuls (hyper-connection mixing, "
    "q/kv/o projections, compressor and indexer projections and pooling, router, top-k + "
    "shared experts) + per-query attention over min(p+1, W) window keys, r(p)=(p+1)//m "
    "closed HCA entries, min(index_topk, r(p)) CSA picks and r(p) indexer scores; "
    "4*Hq*D FLOPs per attended key; see cpmoe/bench/v4_flops.py")


def _window_keys(L: int, W: int) -> int:
    """sum_{p<L} min(p+1, W)."""
    if L <= W:
        return L * (L + 1) // 2
    return W * (W + 1) // 2 + (L - W) * W


def _closed_entries(L: int, m: int, cap: int | None = None) -> int:
    """sum_{p<L} min(cap, (p+1)//m) (no cap: None)."""
    def uncapped(n: int) -> int:  # sum_{q=1..n} q // m
        a, b = divmod(n, m)
        return m * a * (a - 1) // 2 + a * (b + 1)

    if cap is None or L < cap * m:
        return uncapped(L)
    return uncapped(cap * m - 1) + (L - cap * m + 1) * cap


def per_token_flops(cfg: DeepseekV4Config, layer: int) -> int:
    """The terms of one layer that grow linearly with tokens (see the module docstring)."""
    H, D, Hq, hc = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.hc_mult
    ql, I = cfg.q_lora_rank, cfg.moe_intermediate_size
    hyper = 2 * (2 * (hc * H) * ((2 + hc) * hc) + 2 * hc * hc * H)
    attn = (2 * H * ql + 2 * ql * Hq * D + 2 * H * D + 2 * Hq * D * cfg.o_lora_rank
            + 2 * cfg.o_groups * cfg.o_lora_rank * H)
    kind = cfg.layer_types[layer]
    if kind != SLIDING:
        F = (2 if kind == CSA else 1) * D
        attn += 2 * 2 * H * F + 2 * F
    if kind == CSA:
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        attn += 2 * 2 * H * (2 * dI) + 2 * (2 * dI) + 2 * ql * nI * dI + 2 * H * nI
    moe = 2 * H * cfg.num_experts + 6 * (cfg.num_experts_per_tok + 1) * H * I
    return hyper + attn + moe


def attention_flops(cfg: DeepseekV4Config, layer: int, L: int) -> int:
    """The per-query terms of one layer summed over a causal sequence of L tokens."""
    per_key = 4 * cfg.num_attention_heads * cfg.head_dim
    total = per_key * _window_keys(L, cfg.sliding_window)
    kind = cfg.layer_types[layer]
    if kind == HCA:
        total += per_key * _closed_entries(L, cfg.compress_rate_hca)
    elif kind == CSA:
        m, nI, dI = cfg.compress_rate_csa, cfg.index_n_heads, cfg.index_head_dim
        total += per_key * _closed_entries(L, m, cfg.index_topk)
        total += (2 * nI * dI + 2 * nI) * _closed_entries(L, m)
    return total


def v4_prefill_flops(cfg: DeepseekV4Config, seq_lens: list[int]) -> float:
    """Model FLOPs of prefilling sequences of these lengths (each attends only itself)."""
    tokens = sum(seq_lens)
    head = 2 * (cfg.hc_mult * cfg.hidden_size) * cfg.hc_mult
    total = tokens * head
    for layer in range(cfg.num_hidden_layers):
        total += tokens * per_token_flops(cfg, layer)
        total += sum(attention_flops(cfg, layer, L) for L in seq_lens)
    return float(total)
