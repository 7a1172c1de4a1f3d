"""Per-request logits processing before the choice, and log-probabilities after it.

Penalties follow the OpenAI / vLLM definitions, on one row `logits_V` of a request:
- frequency and presence (OpenAI): `l[j] -= c[j] * frequency + (c[j] > 0) * presence`, with
  c[j] the count of token j in the request's generated tokens so far;
- repetition (CTRL / HF / vLLM): every token of the prompt or the output so far has
  `l[j] /= p` where l[j] > 0 and `l[j] *= p` otherwise;
- min_tokens: the EOS ids are impossible (-inf) while fewer tokens were generated.

Log-probabilities are those of the model's raw logits (vLLM's default "raw_logprobs"): the
row's log_softmax before penalties or temperature, so a client can check them against the
model alone.
"""

from __future__ import annotations

import torch

from cpmoe.engine.scheduler import Request


def adjust_logits(logits_V: torch.Tensor, req: Request,
                  eos_ids: frozenset[int] | tuple[int, ...]) -> torch.Tensor:
    """-> a new row with the request's penalties and min_tokens applied (float32)."""
    p = req.params
    out = logits_V.float().clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt) | set(req.output)), dtype=torch.int64,
                            device=out.device)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                vals * p.repetition_penalty)
    if req.output and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
        ids = torch.tensor(req.output, dtype=torch.int64, device=out.device)
        counts = torch.bincount(ids, minlength=out.numel()).to(out.dtype)
        out -= counts * p.frequency_penalty + (counts > 0).to(out.dtype) * p.presence_penalty
    if req.generated < p.min_tokens and eos_ids and not req.ignore_eos:
        out[torch.tensor(sorted(eos_ids), dtype=torch.int64, device=out.device)] = -float("inf")
    return out


def token_logprobs(logits_V: torch.Tensor, token: int, top: int
                   ) -> tuple[float, tuple[tuple[int, float], ...]]:
    """-> (log-probability of `token`, the `top` most likely (token, log-probability) in
    descending order) under log_softmax of the raw row, in float32."""
    lp = torch.log_softmax(logits_V.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.numel()))
        best = tuple(zip(ids.tolist(), vals.tolist()))
    return float(lp[token]), best
