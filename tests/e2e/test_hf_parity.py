"""cpmoe on one rank equals Hugging Face transformers (in-process, float32, tiny checkpoints).

The checkpoints come from tests/conftest.py: the HF model object and the directory it was
saved to hold the same weights, so any difference is cpmoe's (loader, model, runner, decode).

- prefill: logits of every position of a batch (lengths 1, 7, 213, flat order) equal the
  HF logits of each sequence run alone and unpadded, within 1e-4;
- greedy decode: `cpmoe.engine.generate.generate` equals HF `generate(do_sample=False)`
  token for token, per prompt and for both prompts in one batch;
- a checkpoint with tied input/output embeddings (no lm_head tensor) loads and matches;
- an FP8 KV cache (`--kv-cache-dtype fp8_e4m3` / `fp8_e5m2`): the codes stored are HF's keys
  and values rounded to the format, saturating (but for values at a rounding midpoint), and
  every logit greedy decoding samples from (the prefill through the cache, then each decode
  step) equals HF's attending exactly those codes, within 1e-4. With the checkpoint's
  per-layer k_scale / v_scale (each of the three name forms hub checkpoints use) the codes
  are HF's values divided by the scale, and HF attends the codes times the scale.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cpmoe.engine.options import EngineOptions
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner
from cpmoe.parallel.groups import ProcessGroups
from tests._quant_bounds import rounding_flips
from tests.e2e._fp8_helpers import KV_SCALES, with_kv_scales
from tests.e2e._hf_helpers import hf_greedy

KINDS = ("qwen3_moe", "qwen2_moe")
LENGTHS = (1, 7, 213)
TOL = 1e-4
NEW_TOKENS = 12
PROMPT_LENGTHS = (5, 23)


def make_runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, ProcessGroups.single(), torch.float32, show_progress=False)


def random_ids(lengths, seed: int, vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(hf_model, seqs: list[list[int]]) -> torch.Tensor:
    """HF logits of each sequence alone (no padding), concatenated in flat order."""
    outs = [hf_model(input_ids=torch.tensor([s])).logits[0].float() for s in seqs]
    return torch.cat(outs)


@pytest.fixture(scope="module")
def runners(make_hf_checkpoint) -> dict[str, ModelRunner]:
    return {kind: make_runner(make_hf_checkpoint(kind)[1]) for kind in KINDS}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_ids(PROMPT_LENGTHS, seed=11)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_equal_hf(kind, runners, hf_models):
    seqs = random_ids(LENGTHS, seed=3)
    got = runners[kind].prefill(seqs)
    want = hf_logits(hf_models[kind], seqs)
    assert got.shape == want.shape == (sum(LENGTHS), 256)
    assert got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{kind}: max |cpmoe - HF| logit diff {err:.3e} > {TOL}"
    # not vacuous: the logits vary across positions and sequences
    assert want.std().item() > 0.1


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_equals_hf(kind, make_hf_checkpoint, hf_models, prompts):
    model_dir = make_hf_checkpoint(kind)[1]
    want = [hf_greedy(hf_models[kind], p, NEW_TOKENS) for p in prompts]
    # each prompt on a fresh runner (fresh KV cache), then both prompts in one batch
    single = [generate(make_runner(model_dir), [p], NEW_TOKENS)[0] for p in prompts]
    batched = generate(make_runner(model_dir), prompts, NEW_TOKENS)
    for i, (p, w) in enumerate(zip(prompts, want)):
        assert len(w) == NEW_TOKENS
        assert single[i] == w, f"{kind} prompt {i} (len {len(p)}): cpmoe {single[i]} != HF {w}"
    assert batched == single, f"{kind}: batched generate {batched} != per-prompt {single}"
    assert want[0] != want[1]  # the two prompts really decode differently


def test_tied_embeddings_checkpoint_matches_hf(make_hf_checkpoint, prompts):
    hf_model, model_dir = make_hf_checkpoint("qwen3_moe", tie_word_embeddings=True)
    assert hf_model.config.tie_word_embeddings
    runner = make_runner(model_dir)
    assert runner.config.tie_word_embeddings
    assert runner.model.lm_head is None  # the output projection is the embedding
    seqs = random_ids(LENGTHS, seed=5)
    err = (runner.prefill(seqs) - hf_logits(hf_model, seqs)).abs().max().item()
    assert err <= TOL, f"tied embeddings: max |cpmoe - HF| logit diff {err:.3e} > {TOL}"
    want = hf_greedy(hf_model, prompts[1], NEW_TOKENS)
    assert generate(runner, [prompts[1]], NEW_TOKENS) == [want]


FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# cpmoe's and HF's float32 K/V for the same token differ by float32 rounding of different
# kernels (reduction order, fused norm + RoPE), far below this; a code may be the other
# neighbour only where HF's value is this close to a rounding midpoint
KV_REL, KV_ATOL = 1e-4, 1e-6


@contextlib.contextmanager
def recorded_kv_writes():
    """-> the list every K/V write of the run appends to (`cpmoe.ops.norm.to_kv_cache`'s
    results, [T, Hkv, D] each; per forward: layer 0's K, its V, layer 1's K, ...)."""
    import cpmoe.ops.norm as norm
    real, writes = norm.to_kv_cache, []

    def store(x, dtype, inv_scale=None):
        writes.append(real(x, dtype, inv_scale))
        return writes[-1]

    norm.to_kv_cache = store
    try:
        yield writes
    finally:
        norm.to_kv_cache = real


@pytest.mark.parametrize("kind, kv_dtype, scaled", [
    ("qwen3_moe", "fp8_e4m3", False), ("qwen2_moe", "fp8_e4m3", False),
    ("qwen3_moe", "fp8_e5m2", False), ("qwen3_moe", "fp8_e4m3", True)])
def test_fp8_kv_cache_equals_hf_attending_the_stored_codes(kind, kv_dtype, scaled,
                                                           make_hf_checkpoint, hf_models,
                                                           prompts, tmp_path):
    """The K/V codes cpmoe stores are HF's keys and values rounded to the format (code for
    code, but for flips: a value at a rounding midpoint, where the two float32 results may
    round either way, tests/_quant_bounds.py), and HF attending exactly those codes gives
    cpmoe's logits within 1e-4. HF does not round its own keys: that would let one flip
    move the logits past any float32 tolerance. `scaled`: the checkpoint carries K/V-cache
    scales (HF's model ignores them); the codes are the rounding of HF's value times the
    float32 reciprocal of its layer's scale, and HF attends the codes times the scale."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hf, model_dir = hf_models[kind], make_hf_checkpoint(kind)[1]
    layers = hf.config.num_hidden_layers
    scales = [(1.0, 1.0)] * layers
    if scaled:
        model_dir = with_kv_scales(model_dir, tmp_path / "scaled")
        scales = [(k, v) for k, v, _ in KV_SCALES]
        assert len(scales) == layers
    stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attention(module, query, key, value, *args, **kwargs):  # key, value [1, Hkv, T, D]
        exact[module.layer_idx] = (key[0].transpose(0, 1), value[0].transpose(0, 1))
        k, v = ((t.float() * s).transpose(0, 1)[None]
                for t, s in zip(stored[module.layer_idx], scales[module.layer_idx]))
        return sdpa_attention_forward(module, query, k, v, *args, **kwargs)

    name = f"cpmoe_test_{kv_dtype}"
    AttentionInterface.register(name, attention)
    plain = hf.config._attn_implementation
    runner = make_runner(model_dir)
    assert runner.load_stats["kv_scales"] == (layers if scaled else 0)
    flips = total = 0
    for p in prompts:
        steps: list[torch.Tensor] = []
        runner.kv = None  # a fresh cache per prompt
        with recorded_kv_writes() as writes:
            tokens = generate(runner, [p], NEW_TOKENS, observe=steps.append,
                              options=EngineOptions(kv_cache_dtype=kv_dtype))[0]
        fmt = runner.kv.k[0].dtype
        assert fmt == FP8_FORMATS[kv_dtype]
        seq = [p + tokens[:-1]]  # every token whose K/V was stored, in position order
        for layer in range(layers):
            stored[layer] = tuple(torch.cat(writes[2 * layer + kv::2 * layers])
                                  for kv in (0, 1))
            assert stored[layer][0].shape[0] == len(seq[0])
        got = torch.cat(steps)  # [NEW_TOKENS, V]: the last prompt position, then each step
        try:
            hf.set_attn_implementation(name)
            want = hf_logits(hf, seq)[len(p) - 1:]
        finally:
            hf.set_attn_implementation(plain)
        err = (got - want).abs().max().item()
        assert err <= TOL, f"{kind} {kv_dtype}: max |cpmoe - HF| logit diff {err:.3e} > {TOL}"
        for layer in range(layers):
            for codes, values, s in zip(stored[layer], exact[layer], scales[layer]):
                assert codes.dtype == fmt
                inv = 1.0 / torch.tensor(s, dtype=torch.float32)
                flips += rounding_flips(codes, values.float() * inv, KV_REL, KV_ATOL)
                total += codes.numel()
        # not vacuous: attending FP8-rounded K/V moves HF's logits past 10x the tolerance
        assert (hf_logits(hf, seq)[len(p) - 1:] - want).abs().max().item() > 10 * TOL
    assert flips <= total // 100, f"{flips} of {total} codes flipped: more than 1%"
