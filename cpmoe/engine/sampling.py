"""Token choice: greedy, or temperature / top-k / top-p / min-p sampling that is reproducible.

Top-k, top-p and min-p each keep a prefix of the tokens sorted by probability (after the
temperature); the choice is from the shortest of the three, renormalized. min-p keeps the
tokens at least min_p times as likely as the most likely one (vLLM's and SGLang's rule).

A sampled token depends only on (seed, prompt index, step) and the logits: the random number
comes from a generator seeded with those three, and is turned into a token by inverse CDF
over the probabilities sorted by (probability, token id). So the same seed gives the same
tokens on every layout (whose logits agree to ~1e-6), and every rank picks alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int = 0
    # applied to the logits before the choice (cpmoe/engine/logits.py); defaults: no-ops
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS (and the request's stop token ids) impossible before this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit), OpenAI's
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (sampling)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"--min-p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """The row's logits are changed before the choice (penalties, min_tokens, bias)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0
                or bool(self.logit_bias))


def _uniform(seed: int, prompt: int, step: int) -> float:
    # hash() of a tuple of ints is deterministic (no per-process salt) and fits in 64 bits
    gen = torch.Generator().manual_seed(hash((seed, prompt, step)) & (2**63 - 1))
    return torch.rand((), generator=gen, dtype=torch.float64).item()


def sample(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
           step: int) -> list[int]:
    """logits [B, V] (fp32) -> one token per row; row i belongs to prompt prompt_ids[i]."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    out = []
    for row, prompt in zip(logits.double(), prompt_ids):
        probs = torch.softmax(row / params.temperature, dim=-1)
        order = torch.argsort(probs, descending=True, stable=True)
        p = probs[order]
        keep = p.numel() if params.top_k == 0 else min(params.top_k, p.numel())
        if params.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (at least one token)
            reach = int(torch.searchsorted(torch.cumsum(p, 0), params.top_p).item()) + 1
            keep = min(keep, reach)
        if params.min_p > 0.0:  # a prefix too (p is sorted), whatever the renormalization
            keep = min(keep, int((p >= params.min_p * p[0]).sum().item()))
        p = p[:keep] / p[:keep].sum()
        u = _uniform(params.seed, prompt, step)
        idx = min(int(torch.searchsorted(torch.cumsum(p, 0), u).item()), keep - 1)
        out.append(int(order[idx]))
    return out
