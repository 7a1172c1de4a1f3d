"""`--routing uniform`: redrawn routers and scaled residual writers spread a random model's
expert load evenly, the same way on every rank, by weights alone."""

from __future__ import annotations

import torch

from cpmoe.engine.runner import ModelRunner
from cpmoe.moe.placement import ExpertPlacement
from cpmoe.moe.uniform_routing import calibrate_uniform_routing, residual_scaled
from cpmoe.parallel.groups import ProcessGroups

CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=500,
              hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
              max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False)


def prompts(seed: int, batch: int = 24, length: int = 64) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG["vocab_size"], (batch, length), generator=gen).tolist()


def busiest_over_mean(runner: ModelRunner) -> list[float]:
    """Per routed layer: the busiest expert's slots / the mean, over one prefill."""
    runner.record_expert_load()
    runner.prefill(prompts(1), last_only=True)
    out = []
    for m in runner.model.modules():
        if isinstance(m, ExpertPlacement):
            load = m.load.double()
            out.append(float(load.max() / load.mean()))
            m.load = None
    return out


def test_uniform_routing_balances_expert_load_of_new_prompts():
    runner = ModelRunner.from_config(CONFIG, ProcessGroups.single(), torch.float32)
    before = busiest_over_mean(runner)
    redrawn = calibrate_uniform_routing(runner.model, runner.groups,
                                        lambda: runner.prefill(prompts(2), last_only=True))
    after = busiest_over_mean(runner)  # other prompts than the calibration's
    assert redrawn == 3
    assert max(before) > 1.6, before  # as drawn, random weights are unbalanced
    assert max(after) <= 1.5, after


def test_the_scaled_tensors_are_named_alike_in_cpmoe_and_transformers():
    for name in ("model.layers.3.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.mlp.experts.down_proj",
                 "model.layers.1.mlp.shared_expert.down_proj.weight"):
        assert residual_scaled(name)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        assert not residual_scaled(name)
