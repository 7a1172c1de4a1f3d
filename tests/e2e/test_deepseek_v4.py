"""DeepSeek-V4 on one rank equals Hugging Face transformers (in-process, float32).

The checkpoint is a tiny random `DeepseekV4ForCausalLM` saved by `save_pretrained`
(tests/distributed/_v4_tasks.py): every constant-initialised tensor randomised, YaRN on the
compress RoPE, one HCA, two CSA and one sliding-only layer, two hash-routed layers.

- prefill: logits of every position for lengths 1, 7, 130 and 600 (one batch) equal HF run
  on each sequence alone, within 1e-4; 600 tokens pass the HCA rate 128 four times and give
  150 CSA entries against an indexer top-k of 32;
- greedy decode: `generate` equals HF `generate` for 16 tokens, per prompt (one crossing an
  HCA window boundary during decode) and batched;
- every checkpoint tensor maps to exactly one HF parameter name, and the model's parameters
  are exactly HF's persistent state;
- config parsing: transformers' flat/legacy spellings give the same schedule, and unsupported
  fields are refused with one line.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open

from cpmoe.config import ConfigError
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner
from cpmoe.models.deepseek_v4.model import checkpoint_param_name
from cpmoe.models.deepseek_v4.config import (CSA, DECODE_CACHE_NOTE, HCA, SLIDING,
                                              parse_deepseek_v4)
from cpmoe.parallel.groups import ProcessGroups
from tests.distributed._v4_tasks import make_v4_model
from tests.e2e._hf_helpers import hf_greedy

LENGTHS = (1, 7, 130, 600)
TOL = 1e-4
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 125)  # 125 + 16 crosses the HCA boundary at 128 while decoding
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate|up|down)_proj\.weight$")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(HF model, checkpoint dir) with the same weights."""
    return make_v4_model("base", tmp_path_factory.mktemp("deepseek_v4"))


@pytest.fixture(scope="module")
def runner(v4) -> ModelRunner:
    return ModelRunner(v4[1], ProcessGroups.single(), torch.float32, show_progress=False)


def random_ids(lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def test_prefill_logits_match_hf(v4, runner):
    hf_model, _ = v4
    seqs = random_ids(LENGTHS, seed=11)
    runner.kv = None
    got = runner.prefill(seqs).split(list(LENGTHS))
    with torch.no_grad():
        for seq, mine in zip(seqs, got):
            want = hf_model(input_ids=torch.tensor([seq])).logits[0].float()
            diff = (mine - want).abs().max().item()
            assert diff <= TOL, f"length {len(seq)}: logits differ from HF by {diff:.3e}"


def test_greedy_generation_matches_hf(v4, runner):
    hf_model, _ = v4
    prompts = random_ids(PROMPT_LENGTHS, seed=12)
    want = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    for prompt, expected in zip(prompts, want):
        runner.kv = None
        assert generate(runner, [prompt], NEW_TOKENS)[0] == expected, f"prompt {len(prompt)}"
    runner.kv = None
    assert generate(runner, prompts, NEW_TOKENS) == want, "batched prompts"
    assert "share" in DECODE_CACHE_NOTE and "LSE" in DECODE_CACHE_NOTE


def test_prompts_longer_than_a_prefill_chunk_match_hf(v4, runner):
    """Prompts prefilled 8 tokens a step (--chunked-prefill-size), each chunk continuing its
    cached prefix (deepseek_v4/extend.py), give HF's greedy tokens."""
    from cpmoe.engine.options import EngineOptions
    hf_model, _ = v4
    prompts = random_ids([37, 20], seed=13)
    want = [hf_greedy(hf_model, p, 4) for p in prompts]
    runner.kv = None
    assert generate(runner, prompts, 4, options=EngineOptions(chunked_prefill_size=8)) == want


def test_checkpoint_names_map_onto_hf_parameters(v4, runner):
    hf_model, model_dir = v4
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any(".attn.wq_a." in n for n in names), "expected the original DeepSeek names"
    hf_state = set(hf_model.state_dict())
    fused = {n for n in hf_state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    mapped = [checkpoint_param_name(n) for n in names]
    per_expert = [m for m in mapped if _EXPERT.match(m)]
    others = [m for m in mapped if not _EXPERT.match(m)]
    assert sorted(others) == sorted(hf_state - fused)  # each parameter exactly once
    assert {_EXPERT.match(m)[1] for m in per_expert} == {n.rsplit(".", 1)[0] for n in fused}
    assert len(set(per_expert)) == len(per_expert) == 3 * 8 * 4  # projections x experts x layers
    assert set(dict(runner.model.named_parameters())) == hf_state


def _raw_config(**changes) -> dict:
    raw = {"architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
           "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
           "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2,
           "o_lora_rank": 16, "sliding_window": 16, "index_n_heads": 8, "index_head_dim": 16,
           "index_topk": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "hc_mult": 4,
           "compress_ratios": [4, 128, 0, 4], "num_hash_layers": 2, "rope_theta": 10000.0,
           "compress_rope_theta": 160000.0,
           "rope_scaling": {"type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 256}}
    raw.update(changes)
    return raw


def test_flat_config_parses_like_transformers(v4, runner):
    cfg = parse_deepseek_v4(_raw_config())
    assert cfg.layer_types == (CSA, HCA, SLIDING, CSA)
    assert cfg.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe")
    assert cfg.rope_dim == 8 and cfg.rope_main.rope_type == "default"
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.attention_factor == 1.0
    saved = runner.config  # from the nested config.json save_pretrained wrote
    for field in ("layer_types", "mlp_layer_types", "rope_dim", "rope_main", "rope_compress"):
        assert getattr(cfg, field) == getattr(saved, field), field


@pytest.mark.parametrize("change, words", [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"n_shared_experts": 2}, "n_shared_experts=2"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"compress_ratios": [128, 4, 0, 16]}, "layer_types entry 'compress ratio 16'"),
    ({"rope_scaling": {"type": "longrope"}}, "rope_type 'longrope'"),
    ({"o_groups": 3}, "o_groups 3"),
])
def test_unsupported_config_is_refused(change, words):
    with pytest.raises(ConfigError, match=words) as err:
        parse_deepseek_v4(_raw_config(**change))
    assert "\n" not in str(err.value)
