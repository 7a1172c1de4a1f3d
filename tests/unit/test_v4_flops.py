"""The DeepSeek-V4 FLOPs model (cpmoe/bench/v4_flops.py) against independent counts.

- per-query attention terms equal a brute force that walks every (query, key) pair and asks
  whether the model may attend it (window, closed compressed windows, indexer picks);
- the per-token terms equal torch's FLOP counter on a real one-rank forward of a tiny V4
  (4 layers: HCA, CSA, sliding, CSA; hash and top-k MoE; hc 4), once the counter's view of
  the implementation's attention core (it computes masked window slots, and HCA lists as
  long as the longest of the block) and the formula's contractions the implementation does
  elementwise (pooling, the indexer's head-weighted sum) are accounted for by hand;
- `cpmoe bench`'s `model_flops` uses it for V4 configs.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cpmoe.bench import v4_flops
from cpmoe.bench.spec import model_flops
from cpmoe.models.deepseek_v4.config import CSA, HCA, SLIDING, parse_deepseek_v4
from tests.distributed._v4_tasks import V4_CONFIG

LENGTHS = [300, 7, 129]


@pytest.fixture(scope="module")
def raw() -> dict:
    from transformers import DeepseekV4Config
    out = DeepseekV4Config(**V4_CONFIG).to_dict()
    out["architectures"] = ["DeepseekV4ForCausalLM"]
    return out


@pytest.fixture(scope="module")
def cfg(raw):
    return parse_deepseek_v4(raw)


def brute_force_attention(cfg, layer: int, L: int) -> int:
    """Per-query attention FLOPs by enumerating every key a query at p may see."""
    Hq, D, kind = cfg.num_attention_heads, cfg.head_dim, cfg.layer_types[layer]
    total = 0
    for p in range(L):
        keys = sum(1 for j in range(p + 1) if p - j < cfg.sliding_window)
        if kind != SLIDING:
            m = cfg.compress_rate(layer)
            closed = sum(1 for c in range(L) if (c + 1) * m - 1 <= p)
            if kind == HCA:
                keys += closed
            else:
                keys += min(cfg.index_topk, closed)
                nI, dI = cfg.index_n_heads, cfg.index_head_dim
                total += closed * (nI * dI * 2 + nI * 2)
        total += keys * Hq * D * 2 * 2  # QK^T and PV
    return total


@pytest.mark.parametrize("L", [1, 3, 4, 16, 17, 127, 128, 129, 300, 700])
def test_v4_attention_flops_match_brute_force(cfg, L):
    for layer in range(cfg.num_hidden_layers):
        assert v4_flops.attention_flops(cfg, layer, L) == brute_force_attention(cfg, layer, L)


def _implementation_attention(cfg, layer: int, lengths: list[int]) -> int:
    """What the one-rank batched forward's matmuls spend on attention (counted by the FLOP
    counter), all rows in one block: W gathered window slots per row, as many HCA entries
    as the row of the block that sees most (shorter lists masked), min(topk, E) CSA picks,
    indexer scores against every CSA entry up to the last any row sees (in one block: all E
    of the batch; its head-weighted sum is elementwise)."""
    Hq, D, kind = cfg.num_attention_heads, cfg.head_dim, cfg.layer_types[layer]
    keys, scores = cfg.sliding_window, 0
    if kind == HCA:
        keys += max(L // cfg.compress_rate_hca for L in lengths)
    elif kind == CSA:
        E = sum(L // cfg.compress_rate_csa for L in lengths)
        keys += min(cfg.index_topk, E)
        scores = 2 * cfg.index_n_heads * cfg.index_head_dim * E
    return sum(lengths) * (4 * Hq * D * keys + scores)


def _elementwise_contractions(cfg, layer: int) -> int:
    """Per-token terms of the formula that the implementation computes elementwise."""
    kind = cfg.layer_types[layer]
    if kind == SLIDING:
        return 0
    F = (2 if kind == CSA else 1) * cfg.head_dim
    out = 2 * F
    if kind == CSA:
        out += 2 * 2 * cfg.index_head_dim
    return out


def test_v4_flops_match_flop_counter_on_a_forward(raw, cfg):
    from cpmoe.engine.runner import ModelRunner
    from cpmoe.parallel.groups import ProcessGroups

    runner = ModelRunner.from_config(raw, ProcessGroups.single(), torch.float32)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    with FlopCounterMode(display=False) as counter:
        hidden = runner.model.hidden_states(_batch(runner, seqs))
    assert hidden.shape[0] == sum(LENGTHS)
    counted = counter.get_total_flops()
    want = v4_flops.v4_prefill_flops(cfg, LENGTHS)
    T = sum(LENGTHS)
    for layer in range(cfg.num_hidden_layers):
        want += _implementation_attention(cfg, layer, LENGTHS)
        want -= sum(v4_flops.attention_flops(cfg, layer, L) for L in LENGTHS)
        want -= T * _elementwise_contractions(cfg, layer)
    assert counted == want


def _batch(runner, seqs):
    """The one-rank prefill batch the runner builds (no cache)."""
    from cpmoe.cp.attention import query_runs
    from cpmoe.cp.forward_batch import ForwardBatch
    from cpmoe.cp.split import CPSplit

    split = CPSplit.build([len(s) for s in seqs], 1, "zigzag")
    rel, token_to_seq = split.local_positions(0), split.local_token_to_seq(0)
    ids = torch.tensor([t for s in seqs for t in s])
    return ForwardBatch(is_decode=False, input_ids=ids, positions=rel,
                        token_to_seq=token_to_seq, split=split, rel_positions=rel,
                        q_runs=query_runs(rel, token_to_seq))


def test_bench_model_flops_uses_the_v4_formula(cfg):
    assert model_flops(cfg, [4096, 16]) == v4_flops.v4_prefill_flops(cfg, [4096, 16]) > 0


def test_v4_flops_at_default_widths_are_dominated_by_projections_and_experts():
    """A sanity scale at transformers' default widths, 4 layers, one 16K prompt: about
    0.29 GFLOP per token of projections, experts and hyper-connections per layer."""
    from transformers import DeepseekV4Config
    raw = DeepseekV4Config(num_hidden_layers=4).to_dict()
    raw["architectures"] = ["DeepseekV4ForCausalLM"]
    big = parse_deepseek_v4(raw)
    per_token = sum(v4_flops.per_token_flops(big, i) for i in range(4)) / 4
    assert 1e8 < per_token < 1e9
    total = v4_flops.v4_prefill_flops(big, [16384])
    assert total > 16384 * 4 * per_token
