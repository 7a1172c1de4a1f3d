"""The tiny DeepSeek-V4 of the interpreter scripts: three layers (a rate-128 compressed, a
rate-4 sparse and a sliding-window one) small enough for Triton's CPU interpreter."""

from __future__ import annotations


def tiny_v4(hc_mult: int) -> dict:
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 128, "hidden_size": 64, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 32,
        "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
        "sliding_window": 24, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "hc_mult": hc_mult,
        "compress_ratios": [128, 4, 0], "num_hash_layers": 1, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
    }
