"""Reproducible sampling: the token depends only on (seed, prompt index, step) and logits."""

from __future__ import annotations

import torch

from cpmoe.engine.sampling import SamplingParams, sample


def test_sampling_accepts_any_64_bit_seed_and_is_reproducible():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    for seed in (0, 7, 2**40, 2**63 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert sample(logits, params, [0, 1], 3) == sample(logits, params, [0, 1], 3)


def test_a_step_chooses_each_row_as_its_request_alone_would() -> None:
    """Greedy rows are chosen together, sampled rows one by one: every row gets what
    `sample` gives that request's row on its own (its params, stream and step)."""
    from cpmoe.engine.engine import choose_tokens
    from cpmoe.engine.scheduler import Request
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=10, seed=3),
              SamplingParams(top_k=1, temperature=0.5), SamplingParams(),
              SamplingParams(temperature=1.2, top_p=0.8, seed=4), SamplingParams()]
    rows = [Request(i, [1, 2], p, 8, stream=i, output=[5] * i) for i, p in enumerate(params)]
    want = [sample(logits[i:i + 1], r.params, [r.stream], r.generated)[0]
            for i, r in enumerate(rows)]
    assert choose_tokens(logits, rows) == want
    assert choose_tokens(logits[[0, 3, 5]], [rows[0], rows[3], rows[5]]) == \
        logits[[0, 3, 5]].argmax(-1).tolist()
