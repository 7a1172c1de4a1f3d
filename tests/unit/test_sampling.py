"""Reproducible sampling: the token depends only on (seed, prompt index, step) and logits."""

from __future__ import annotations

import torch

from cpmoe.engine.sampling import SamplingParams, sample


def test_sampling_accepts_any_64_bit_seed_and_is_reproducible():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    for seed in (0, 7, 2**40, 2**63 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert sample(logits, params, [0, 1], 3) == sample(logits, params, [0, 1], 3)
