"""Per-request logits processing before the choice, and log-probabilities after it.

Penalties follow the OpenAI / vLLM definitions, on one row `logits_V` of a request:
- frequency and presence (OpenAI): `l[j] -= c[j] * frequency + (c[j] > 0) * presence`, with
  c[j] the count of token j in the request's generated tokens so far;
- repetition (CTRL / HF / vLLM): every token of the prompt or the output so far has
  `l[j] /= p` where l[j] > 0 and `l[j] *= p` otherwise;
- logit_bias (OpenAI): `l[j] += bias[j]` for the listed tokens;
- min_tokens: the EOS ids and the request's stop token ids are impossible (-inf) while fewer
  tokens were generated (vLLM's rule).

Log-probabilities are those of the model's raw logits (vLLM's default "raw_logprobs"): the
row's log_softmax before penalties or temperature, so a client can check them against the
model alone.
"""

from __future__ import annotations

import torch

from cpmoe.engine.request import Request


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
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        out[torch.tensor(ids, dtype=torch.int64, device=out.device)] += torch.tensor(
            bias, dtype=out.dtype, device=out.device)
    if req.generated < p.min_tokens:
        stops = set(req.stop_ids) | (set() if req.ignore_eos else set(eos_ids))
        if stops:
            out[torch.tensor(sorted(stops), dtype=torch.int64, device=out.device)] = -float("inf")
    return out


def prompt_logprobs(logits_LV: torch.Tensor, targets: list[int], top: int
                    ) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Rows of consecutive prompt positions and the prompt token after each (`targets`, at
    most one per row) -> (log-probability of that token, the `top` most likely) per target,
    under log_softmax of the raw rows in float32 (one copy to the host)."""
    lp = torch.log_softmax(logits_LV[:len(targets)].float(), dim=-1)
    ids = torch.tensor(targets, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if top <= 0:
        return [(c, ()) for c in chosen]
    vals, best = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    return [(c, tuple(zip(b, v))) for c, b, v in zip(chosen, best.tolist(), vals.tolist())]


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
