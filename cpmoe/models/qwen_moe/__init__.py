"""Qwen3-MoE and Qwen2-MoE: `config.py` (`QwenMoeConfig` from HF's config.json, its checks)
and `model.py` (attention, MoE block, decoder layer, model, causal-LM head, HF names)."""
