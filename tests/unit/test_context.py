"""The context length: parsed from config.json (Qwen and DeepSeek-V4), lowered by
--context-length, enforced as prompt + max_tokens <= context length."""

from __future__ import annotations

import pytest

from cpmoe.config import ConfigError
from cpmoe.context import context_length, over_context
from cpmoe.models.registry import config_from_dict

QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
         "num_experts_per_tok": 2, "rope_theta": 1e6}
V4 = {"architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
      "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
      "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2,
      "o_lora_rank": 16, "sliding_window": 16, "index_n_heads": 8, "index_head_dim": 16,
      "index_topk": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "hc_mult": 4,
      "compress_ratios": [128, 4, 0, 4], "num_hash_layers": 2, "rope_theta": 10000.0}


@pytest.mark.parametrize("raw", [QWEN3, {**QWEN3, "architectures": ["Qwen2MoeForCausalLM"],
                                         "shared_expert_intermediate_size": 48}, V4],
                         ids=["qwen3", "qwen2", "deepseek-v4"])
def test_config_reads_max_position_embeddings(raw):
    cfg, _ = config_from_dict({**raw, "max_position_embeddings": 512})
    assert cfg.max_position_embeddings == 512


@pytest.mark.parametrize("raw,default", [(QWEN3, 32768), (V4, 1048576)],
                         ids=["qwen3", "deepseek-v4"])
def test_config_without_max_position_embeddings_takes_transformers_default(raw, default):
    from transformers import DeepseekV4Config, Qwen3MoeConfig
    hf = Qwen3MoeConfig if raw is QWEN3 else DeepseekV4Config
    assert config_from_dict(raw)[0].max_position_embeddings == default
    assert hf().max_position_embeddings == default


@pytest.mark.parametrize("bad", [0, -5, "512", 512.0, True])
def test_config_with_bad_max_position_embeddings_is_one_line(bad):
    with pytest.raises(ConfigError) as info:
        config_from_dict({**QWEN3, "max_position_embeddings": bad}, "m/config.json")
    msg = str(info.value)
    assert "\n" not in msg and "m/config.json" in msg and "max_position_embeddings" in msg
    assert repr(bad) in msg


def test_context_length_flag_may_only_lower_the_models():
    assert context_length(512, None) == 512
    assert context_length(512, 100) == 100
    assert context_length(512, 512) == 512
    with pytest.raises(ValueError, match=r"^--context-length 513: longer than the model's 512 "):
        context_length(512, 513)
    with pytest.raises(ValueError, match=r"^--context-length must be >= 1, got 0$"):
        context_length(512, 0)


def test_over_context_names_both_numbers_and_allows_exactly_the_limit():
    assert over_context(500, 12, 512) is None
    assert over_context(512, 0, 512) is None
    assert over_context(594, 32, 512, "prompt", "--max-new-tokens") == (
        "prompt of 594 tokens + --max-new-tokens 32 = 626 tokens exceeds the context length "
        "of 512 tokens")
    assert over_context(513, 0, 512, "prompt 3") == (
        "prompt 3 of 513 tokens exceeds the context length of 512 tokens")
    assert "1000000500" in over_context(500, 10**9, 512)
