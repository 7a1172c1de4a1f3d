"""Reproducible sampling: the token depends only on (seed, prompt index, step) and logits."""

from __future__ import annotations

import pytest
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
    from cpmoe.engine.request import Request
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


def _penalised_by_hand(logits: list[float], prompt: list[int], output: list[int],
                       presence: float, frequency: float, repetition: float) -> list[float]:
    """The OpenAI (presence, frequency) and CTRL/vLLM (repetition) definitions, per token."""
    out = list(logits)
    for j in range(len(out)):
        if j in prompt or j in output:
            out[j] = out[j] / repetition if out[j] > 0 else out[j] * repetition
        c = output.count(j)
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


def test_penalties_match_openai_definitions_by_hand() -> None:
    from cpmoe.engine.logits import adjust_logits
    from cpmoe.engine.request import Request
    row = torch.randn(30, generator=torch.Generator().manual_seed(1))
    prompt, output = [1, 2, 3, 3], [5, 7, 5, 2, 5]
    for pres, freq, rep in [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3),
                            (-0.4, 1.1, 0.8), (1.5, -0.3, 1.7)]:
        params = SamplingParams(presence_penalty=pres, frequency_penalty=freq,
                                repetition_penalty=rep)
        req = Request(0, prompt, params, 16, output=list(output))
        got = adjust_logits(row, req, ()).tolist()
        want = _penalised_by_hand(row.tolist(), prompt, output, pres, freq, rep)
        assert got == pytest.approx(want, abs=1e-6), (pres, freq, rep)


def test_min_tokens_forbids_eos_until_reached_and_greedy_penalised_rows_use_them() -> None:
    from cpmoe.engine.engine import choose_tokens
    from cpmoe.engine.request import Request
    logits = torch.zeros(3, 10)
    logits[:, 9] = 5.0  # EOS is the argmax
    logits[:, 4] = 4.0
    rows = [Request(0, [1], SamplingParams(min_tokens=2), 8, output=[4]),
            Request(1, [1], SamplingParams(min_tokens=2), 8, output=[4, 4]),
            Request(2, [1], SamplingParams(frequency_penalty=2.0), 8, output=[9])]
    # row 0: one token so far < 2 -> EOS impossible; row 1: reached; row 2: 5 - 2 < 4
    assert choose_tokens(logits, rows, eos_ids=(9,)) == [4, 9, 4]


def test_token_logprobs_are_log_softmax_of_the_row() -> None:
    from cpmoe.engine.logits import token_logprobs
    row = torch.randn(40, generator=torch.Generator().manual_seed(2))
    ref = [x - torch.logsumexp(row.double(), 0).item() for x in row.double().tolist()]
    lp, top = token_logprobs(row, 7, 3)
    assert lp == pytest.approx(ref[7], abs=1e-5)
    order = sorted(range(40), key=lambda j: -ref[j])[:3]
    assert [t for t, _ in top] == order
    assert [v for _, v in top] == pytest.approx([ref[j] for j in order], abs=1e-5)
