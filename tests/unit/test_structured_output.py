"""Structured output and the sampling fields, without a server.

- the device-side bitmask equals xgrammar's own `apply_token_bitmask_inplace` (the reference);
- the engine with grammars: rows with and without a grammar share steps; every grammar
  output matches its grammar (checked with `re` / `json` / `jsonschema`, not xgrammar);
  overlapped steps give the tokens of synced steps, and grammar rows do run overlapped;
  the rows without a grammar give the tokens they give alone;
- the reasoning and tool-call parsers give the same result streamed piece by piece as whole;
- min_p, logit_bias and stop token ids as vLLM / SGLang define them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from cpmoe.engine import engine
from cpmoe.engine.engine import BatchFrontend, Driver, engine_loop
from cpmoe.engine.grammar import GrammarBackend, GrammarSpec, apply_token_bitmask
from cpmoe.engine.logits import adjust_logits
from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sampling import SamplingParams, sample
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import Request
from cpmoe.models.registry import load_model_config
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.serve.reasoning import Qwen3Reasoning
from cpmoe.serve.tool_calls import Qwen25ToolCalls

SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
             "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["city", "days", "tags", "ok"]}
REGEX = "[a-d]{3}-[0-9]{2}"


# ---- the bitmask -----------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [64, 259, 1000])
def test_bitmask_on_logits_equals_xgrammars_apply(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=gen, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[2] = -1  # a row without a grammar: every token allowed
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, mask)
    got = apply_token_bitmask(logits, mask)
    assert torch.equal(got, want)
    assert torch.equal(got[2], logits[2])


# ---- the engine with grammars ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_cache) -> Path:
    return default_model_cache(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, ProcessGroups.single(), torch.float32, show_progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


GRAMMARS = [GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("regex", REGEX),
            None, GrammarSpec("json_schema", json.dumps(SCHEMA)), None,
            GrammarSpec("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]')]


def _run(runner, model_dir, grammars, overlap, sampling=SamplingParams(), max_tokens=80):
    """The built-in model through the engine loop: one request per grammar (None: none),
    prompts of different lengths -> (tokens per request, plans that had grammar rows)."""
    cfg, _ = load_model_config(model_dir)
    runner.kv = None
    kv = runner.allocate_kv(4096, 16)
    requests = [Request(i, [(37 * i + 11 * j) % 250 for j in range(3 + 5 * i)], sampling,
                        max_tokens, stream=i, grammar=g) for i, g in enumerate(grammars)]
    sched = Scheduler(kv, "zigzag", 32, 64, tuple(cfg.eos_token_ids))
    backend = GrammarBackend(model_dir, cfg.vocab_size, tuple(cfg.eos_token_ids))
    driver = Driver(runner, sched, BatchFrontend(requests), overlap=overlap, grammars=backend)
    seen: list = []
    step = engine.run_step

    def spy(runner, plan, sched, *rest):
        rows = sched.sample_rows(plan)
        if any(r.grammar is not None for r in rows):
            seen.append((plan.overlap, sum(r.grammar is None for r in rows)))
        return step(runner, plan, sched, *rest)

    engine.run_step = spy
    try:
        return engine_loop(runner, driver), seen, tuple(cfg.eos_token_ids)
    finally:
        engine.run_step = step
        backend.close()


def _text(tokenizer, tokens, eos) -> str:
    assert tokens[-1] in eos, "a grammar output ends with EOS once complete"
    return tokenizer.decode(tokens[:-1])


def _check(tokenizer, grammar: GrammarSpec, tokens: list[int], eos) -> None:
    text = _text(tokenizer, tokens, eos)
    if grammar.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif grammar.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def test_engine_grammar_rows_match_their_grammar_and_share_steps_with_plain_rows(
        runner, model_dir, tokenizer):
    synced, seen_synced, eos = _run(runner, model_dir, GRAMMARS, overlap=False)
    overlapped, seen, _ = _run(runner, model_dir, GRAMMARS, overlap=True)
    for g, tokens in zip(GRAMMARS, synced):
        if g is not None:
            _check(tokenizer, g, tokens, eos)
    assert overlapped == synced
    assert any(plain for _, plain in seen_synced), "no step mixed grammar and plain rows"
    assert any(o for o, _ in seen), "no grammar step ran overlapped"
    alone, _, _ = _run(runner, model_dir, [None] * len(GRAMMARS), overlap=False)
    for g, tokens, free in zip(GRAMMARS, synced, alone):
        if g is None:
            assert tokens == free


def test_engine_sampled_grammar_rows_match_their_grammar(runner, model_dir, tokenizer):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    got, _, eos = _run(runner, model_dir, GRAMMARS[:2] * 3, overlap=True, sampling=params)
    for g, tokens in zip(GRAMMARS[:2] * 3, got):
        _check(tokenizer, g, tokens, eos)
    assert len({tuple(t) for t in got[::2]}) > 1  # the samples differ


# ---- parsers: streamed piece by piece equals whole -------------------------------------------

def _parse(parser_cls, text: str, step: int) -> list:
    parser, out = parser_cls(), []
    for at in range(0, len(text), step):
        out += parser.feed(text[at:at + step])
    out += parser.finish()
    merged: list = []  # adjacent pieces of one kind joined
    for kind, value in out:
        if merged and kind == merged[-1][0] and isinstance(value, str):
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


REASONING = [
    ("<think>\nplan a\n\nplan b \n</think>\n\nThe answer.",
     [("reasoning", "plan a\n\nplan b"), ("content", "The answer.")]),
    ("  <think>cut off", [("reasoning", "cut off")]),
    ("No thinking <think>here</think>", [("content", "No thinking <think>here</think>")]),
    ("<think></think>\nHi", [("content", "Hi")]),
    ("<thin", [("content", "<thin")]),
]


@pytest.mark.parametrize("text,want", REASONING)
def test_qwen3_reasoning_split_streamed_equals_whole(text, want):
    for step in (len(text), 1, 2, 3):
        assert _parse(Qwen3Reasoning, text, step) == want


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "a\\"b"}}\n</tool_call>'
TOOL_TEXTS = [
    (CALL, [("call", {"name": "f", "arguments": '{"x": 1, "s": "a\\"b"}'})]),
    (f"Let me check.\n{CALL}\n{CALL}\n",
     [("content", "Let me check."), ("call", {"name": "f", "arguments": '{"x": 1, "s": "a\\"b"}'}),
      ("call", {"name": "f", "arguments": '{"x": 1, "s": "a\\"b"}'})]),
    ("<tool_call>\nnot json\n</tool_call> after",
     [("content", "<tool_call>\nnot json\n</tool_call> after")]),
    ('plain <tool_call>{"name": "f", "argu', [("content", 'plain <tool_call>{"name": "f", "argu')]),
    ("text only, ends in a blank \n", [("content", "text only, ends in a blank \n")]),
]


@pytest.mark.parametrize("text,want", TOOL_TEXTS)
def test_qwen25_tool_calls_streamed_equal_whole(text, want):
    for step in (len(text), 1, 2, 5):
        assert _parse(Qwen25ToolCalls, text, step) == want


# ---- sampling fields ---------------------------------------------------------------------------

def test_min_p_keeps_only_tokens_near_the_most_likely():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.5]])
    probs = torch.softmax(logits[0].double(), -1)
    keep = {i for i in range(5) if probs[i] >= 0.5 * probs.max()}
    assert keep == {0, 1, 4}
    picked = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5, seed=s), [0], 0)[0]
              for s in range(200)}
    assert picked == keep
    always = {sample(logits, SamplingParams(temperature=1.0, min_p=1.0, seed=s), [0], 0)[0]
              for s in range(50)}
    assert always == {0}


def test_logit_bias_adds_to_the_logits_and_min_tokens_blocks_stop_token_ids():
    logits = torch.randn(16, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(logit_bias=((3, 100.0), (7, -5.5)), min_tokens=2)
    req = Request(0, [1, 2], params, 8, stop_ids=(9,))
    want = logits.clone()
    want[3] += 100.0
    want[7] -= 5.5
    want[[5, 9]] = -float("inf")
    assert torch.equal(adjust_logits(logits, req, (5,)), want)
    req.output = [4, 4]  # min_tokens reached: the stop ids are possible again
    want[[5, 9]] = logits[[5, 9]]
    assert torch.equal(adjust_logits(logits, req, (5,)), want)


def test_stop_token_id_finishes_with_stop_and_a_grammar_ends_on_eos_despite_ignore_eos():
    from cpmoe.cp.kv_cache import PagedKVCache
    kv = PagedKVCache(1, 64, 4, 1, 4, torch.float32, torch.device("cpu"))
    sched = Scheduler(kv, "zigzag", 0, 8, (0,))
    plain = Request(1, [5, 6], SamplingParams(), 10, stop_ids=(7,))
    ignoring = Request(2, [5, 6], SamplingParams(), 10, ignore_eos=True)
    constrained = Request(3, [5, 6], SamplingParams(), 10, ignore_eos=True,
                          grammar=GrammarSpec("regex", "a"))
    for r in (plain, ignoring, constrained):
        sched.add(r)
    plan = sched.plan()
    events = sched.record(plan, [7, 0, 0])
    assert [(e.rid, e.finish) for e in events] == [(1, "stop"), (2, None), (3, "stop")]
