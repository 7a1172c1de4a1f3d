"""The OpenAI API surface of `cpmoe serve` through the real `openai` client: tolerant parsing,
logprobs, n, penalties, min_tokens, echo, several prompts, models/{id}, --skip-tokenizer-init,
the prefix cache's usage counts and the profiler endpoints.

Two one-rank servers start once for the module (one with a tokenizer, one without). Every
reference is computed here, independently of the server: tokens and logits of `cpmoe generate`
in this process (`Reference`), log_softmax of those logits, and penalties applied by hand to
logits of a plain prefill, step by step.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai import OpenAI

from tests.e2e._serve_helpers import (  # noqa: F401 -- shared module fixtures
    Reference, Server, cache_dir, model_dir, ready_servers, reference, tokenizer)

PROMPT = "Context parallel prefill"
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, cache_dir, model_dir):
    work = tmp_path_factory.mktemp("serve-api")
    started = {"text": Server(work, cache_dir, "--max-total-tokens", "4096"),
               "ids": Server(work, cache_dir, "--max-total-tokens", "1024",
                             "--skip-tokenizer-init")}
    yield from ready_servers(started)


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["text"]


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


# ---- (1) tolerant parsing ----------------------------------------------------------------------

def test_harmless_defaults_and_unknown_fields_are_accepted_and_change_nothing(
        server, reference, tokenizer):
    client = _client(server)
    messages = [{"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "Another."}]
    resp = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=6, temperature=0,
        response_format={"type": "text"}, top_logprobs=0, tool_choice="none",
        parallel_tool_calls=False, stream=False, presence_penalty=0, frequency_penalty=0,
        n=1, logit_bias={}, user="u1", store=False,
        extra_body={"chat_template_kwargs": {}, "repetition_penalty": 1.0, "min_tokens": 0,
                    "return_token_ids": True, "some_future_field": {"x": 1}, "min_p": 0.0})
    text = tokenizer.apply_chat_template(
        [{**m, "content": m["content"] or ""} for m in messages], add_generation_prompt=True,
        tokenize=False)
    want = reference.tokens(tokenizer.encode(text, add_special_tokens=False), 6)
    assert resp.choices[0].token_ids == want
    chunks = list(client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": False,
                        "future_sub_field": 1},
        extra_body={"best_of": 1, "echo": False, "typo_fieldd": 3}))
    assert chunks[-1].usage.completion_tokens == 4
    got = "".join(c.choices[0].text for c in chunks if c.choices)
    assert got == tokenizer.decode(reference.tokens(tokenizer.encode(PROMPT), 4),
                                   skip_special_tokens=True)
    err = server.stderr()
    assert "ignoring unknown field(s) some_future_field" in err
    assert "stream_options.future_sub_field" in err and "typo_fieldd" in err


UNHONOURABLE = [  # (endpoint, body, field named, value quoted in the message)
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "xml"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "required"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "--tool-call-parser"),  # this server has none
    ("chat", {"logprobs": False, "top_logprobs": 3}, "top_logprobs", "3"),
    ("chat", {"stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "True"),
    ("completions", {"best_of": 2, "n": 3}, "best_of", "2"),
    ("completions", {"best_of": 3, "stream": True}, "best_of", "3"),
    ("completions", {"logit_bias": {"5": 1000.0}}, "logit_bias", "1000.0"),
    ("completions", {"use_beam_search": True}, "use_beam_search", "True"),
    ("completions", {"stop_token_ids": [999999]}, "stop_token_ids", "999999"),
    ("completions", {"min_p": 1.5}, "min_p", "1.5"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "0"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    ("completions", {"min_tokens": 10, "max_tokens": 4}, "min_tokens", "10"),
    ("completions", {"n": 17}, "n", "17"),
    ("completions", {"logprobs": 21}, "logprobs", "21"),
]


@pytest.mark.parametrize("endpoint,body,field,value", UNHONOURABLE,
                         ids=[f"{e}-{f}" for e, _, f, _ in UNHONOURABLE])
def test_unhonourable_value_gets_one_400_naming_field_and_value(server, endpoint, body, field,
                                                                value):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
            else {"prompt": "hi"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(f"{server.url}{path}", json={"model": server.model, "max_tokens": 2,
                                                 **base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field.split(".")[0] or err["param"] == field, err
    assert field.split(".")[-1] in err["message"] and value in err["message"], err


# ---- (2) logprobs --------------------------------------------------------------------------------

def _names_match(tokenizer, names: list[str], tokens: list[int]) -> bool:
    """A token is named by its text, or "bytes:..." when it is part of a character."""
    for name, t in zip(names, tokens, strict=True):
        text = tokenizer.decode([t])
        if not (name.startswith("bytes:\\x") if "\ufffd" in text else name == text):
            return False
    return True


def _want_logprobs(reference, prompt_ids: list[int], n: int, top: int):
    """(tokens, chosen logprobs, top (token, logprob) per step) from log_softmax of the
    engine's logits of `cpmoe generate`, greedy."""
    (tokens,), logits = reference.batch([prompt_ids], n)
    lps = [torch.log_softmax(row[0].double(), -1) for row in logits]
    chosen = [lp[t].item() for lp, t in zip(lps, tokens)]
    tops = [[(int(i), v.item()) for v, i in zip(*torch.topk(lp, top))] for lp in lps]
    return tokens, chosen, tops


def test_completion_logprobs_equal_log_softmax_of_engine_logits(server, reference, tokenizer):
    client = _client(server)
    ids = tokenizer.encode(PROMPT)
    tokens, chosen, tops = _want_logprobs(reference, ids, 6, 3)
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
          "logprobs": 3, "extra_body": {"return_token_ids": True}}
    resp = client.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.token_ids == tokens
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-5)
    assert _names_match(tokenizer, lp.tokens, tokens)
    for got, want in zip(lp.top_logprobs, tops, strict=True):
        assert list(got.values()) == pytest.approx([v for _, v in want], abs=1e-5)
        assert _names_match(tokenizer, list(got), [t for t, _ in want])
    assert lp.text_offset[0] == 0
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(chosen, abs=1e-5)


def test_chat_logprobs_equal_log_softmax_of_engine_logits(server, reference, tokenizer):
    client = _client(server)
    messages = [{"role": "user", "content": "Name a prime."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens, chosen, tops = _want_logprobs(
        reference, tokenizer.encode(text, add_special_tokens=False), 5, 2)
    kw = {"model": server.model, "messages": messages, "max_tokens": 5, "temperature": 0,
          "logprobs": True, "top_logprobs": 2}
    resp = client.chat.completions.create(**kw)
    content = resp.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(chosen, abs=1e-5)
    assert _names_match(tokenizer, [c.token for c in content], tokens)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == \
        tokenizer.decode(tokens)
    assert [[t.logprob for t in c.top_logprobs] for c in content] == \
        [pytest.approx([v for _, v in w], abs=1e-5) for w in tops]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx(chosen, abs=1e-5)


# ---- (2) n, several prompts, echo, models -------------------------------------------------------

def test_n3_with_seed_gives_three_reproducible_distinct_samples_equal_generate(
        server, reference, tokenizer):
    client = _client(server)
    ids = tokenizer.encode(PROMPT)
    (want, _) = reference.batch([ids] * 3, 8, **SAMPLED)
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "n": 3, **SAMPLED,
          "extra_body": {"return_token_ids": True}}
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    for resp in (first, second):
        got = sorted(resp.choices, key=lambda c: c.index)
        assert [c.index for c in got] == [0, 1, 2]
        assert [c.token_ids for c in got] == want
    assert len({tuple(w) for w in want}) == 3  # distinct
    assert first.usage.prompt_tokens == len(ids)
    assert first.usage.completion_tokens == sum(len(w) for w in want)
    chunks = list(client.completions.create(**kw, stream=True))
    per = {i: [t for c in chunks for ch in c.choices if ch.index == i for t in ch.token_ids]
           for i in range(3)}
    assert [per[i] for i in range(3)] == want
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3,
        **SAMPLED)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_best_of_keeps_the_candidates_with_highest_mean_logprob(server, reference,
                                                                 tokenizer):
    """best_of 4, n 2: the candidates are generate's streams 0..3; the two kept are those
    whose tokens have the highest mean log_softmax (computed here by plain prefills)."""
    ids = tokenizer.encode(PROMPT)
    (cands, _) = reference.batch([ids] * 4, 5, **SAMPLED)

    def mean_logprob(out: list[int]) -> float:
        lps = [torch.log_softmax(reference.next_logits(ids + out[:k]).double(), -1)[t].item()
               for k, t in enumerate(out)]
        return sum(lps) / len(lps)

    want = sorted(cands, key=mean_logprob, reverse=True)[:2]
    resp = _client(server).completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, n=2, best_of=4, **SAMPLED,
        extra_body={"return_token_ids": True})
    assert [c.token_ids for c in resp.choices] == want
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.logprobs is None for c in resp.choices)  # not asked for


def test_several_prompts_in_one_request_equal_generate_of_that_batch(server, reference,
                                                                    tokenizer):
    prompts = [PROMPT, "The quick brown fox"]
    (want, _) = reference.batch([tokenizer.encode(p) for p in prompts], 6, **SAMPLED)
    resp = _client(server).completions.create(
        model=server.model, prompt=prompts, max_tokens=6, **SAMPLED,
        extra_body={"return_token_ids": True})
    assert [c.token_ids for c in sorted(resp.choices, key=lambda c: c.index)] == want
    assert resp.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)


def test_echo_puts_the_prompt_before_the_completion(server, reference, tokenizer):
    client = _client(server)
    out = tokenizer.decode(reference.tokens(tokenizer.encode(PROMPT), 5),
                           skip_special_tokens=True)
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                     temperature=0, echo=True)
    assert resp.choices[0].text == PROMPT + out
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                            temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + out


def test_models_retrieve_names_the_served_model(server):
    client = _client(server)
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# ---- (2) penalties and min_tokens ---------------------------------------------------------------

def _greedy_with_penalties_by_hand(reference, prompt: list[int], steps: int, presence: float,
                                   frequency: float, repetition: float) -> list[int]:
    """Greedy tokens where each step's logits (a plain prefill) get the OpenAI presence /
    frequency penalties and the CTRL repetition penalty, written out per token."""
    out: list[int] = []
    for _ in range(steps):
        logits = reference.next_logits(prompt + out).tolist()
        for j in set(prompt) | set(out):
            logits[j] = logits[j] / repetition if logits[j] > 0 else logits[j] * repetition
        for j in set(out):
            logits[j] -= out.count(j) * frequency + presence
        out.append(max(range(len(logits)), key=logits.__getitem__))
    return out


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                                     {"repetition_penalty": 1.8}],
                         ids=["frequency", "presence", "repetition"])
def test_penalties_change_tokens_as_openai_definitions_say(server, reference, tokenizer,
                                                           penalty):
    ids = tokenizer.encode(PROMPT)
    want = _greedy_with_penalties_by_hand(
        reference, ids, 10, penalty.get("presence_penalty", 0.0),
        penalty.get("frequency_penalty", 0.0), penalty.get("repetition_penalty", 1.0))
    assert want != reference.tokens(ids, 10)  # the penalty matters on this prompt
    extra = {"return_token_ids": True, "ignore_eos": True}
    top = {k: v for k, v in penalty.items() if k != "repetition_penalty"}
    if "repetition_penalty" in penalty:
        extra["repetition_penalty"] = penalty["repetition_penalty"]
    resp = _client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=10,
                                              temperature=0, extra_body=extra, **top)
    assert resp.choices[0].token_ids == want


def test_min_tokens_defers_eos(server, reference, tokenizer):
    """Where greedy decoding ends with EOS, min_tokens past that point makes EOS impossible
    until then: the tokens equal the EOS-masked greedy computed by hand."""
    eos = set(reference.eos_ids)
    candidates = [tokenizer.encode(f"prompt {i}:") for i in range(40)]
    # one batched greedy run screens the 40 prompts (40 one-prompt runs took ~100 CPU-s);
    # the chosen prompt's tokens are then the one-prompt run's, as before
    screened, _ = reference.batch(candidates, 12)
    for ids, batched in zip(candidates, screened):  # a prompt whose greedy output ends early
        if batched[-1] not in eos or len(batched) >= 10:
            continue
        plain = reference.tokens(ids, 12)
        if plain[-1] in eos and len(plain) < 10:
            break
    else:
        pytest.skip("no prompt of this tiny model reaches EOS within 12 tokens")
    min_tokens = len(plain) + 2
    want: list[int] = []
    while True:
        logits = reference.next_logits(ids + want)
        if len(want) < min_tokens:
            logits[list(eos)] = -math.inf
        want.append(int(logits.argmax()))
        if want[-1] in eos or len(want) == 16:
            break
    resp = _client(server).completions.create(
        model=server.model, prompt=ids, max_tokens=16, temperature=0,
        extra_body={"min_tokens": min_tokens, "return_token_ids": True})
    assert resp.choices[0].token_ids == want and len(want) > min_tokens - 1


def test_min_tokens_holds_stop_strings_back_until_reached(server, reference, tokenizer):
    """As in vLLM, a stop string counts only once min_tokens tokens were generated: a stop
    string found only early in the output cuts it without min_tokens, and not with
    min_tokens = max_tokens."""
    ids = tokenizer.encode(PROMPT)
    want = reference.tokens(ids, 16)
    assert len(want) == 16  # no EOS on this prompt: min_tokens changes no token
    full = tokenizer.decode(want, skip_special_tokens=True)
    stop = next(full[i:i + 2] for i in range(2, 8) if full.count(full[i:i + 2]) == 1
                and "\ufffd" not in full[i:i + 2])
    client = _client(server)
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
          "stop": [stop]}
    assert client.completions.create(**kw).choices[0].text == full[:full.index(stop)]
    held = client.completions.create(**kw, extra_body={"min_tokens": 16})
    assert held.choices[0].text == full


# ---- --skip-tokenizer-init ----------------------------------------------------------------------

def test_skip_tokenizer_init_serves_token_ids_and_refuses_text(servers, reference, tokenizer):
    server = servers["ids"]
    client = _client(server)
    ids = tokenizer.encode(PROMPT)
    resp = client.completions.create(model=server.model, prompt=ids, max_tokens=6,
                                     temperature=0)
    assert resp.choices[0].token_ids == reference.tokens(ids, 6)
    assert resp.choices[0].text == ""
    chunks = list(client.completions.create(model=server.model, prompt=ids, max_tokens=6,
                                            temperature=0, stream=True))
    assert [t for c in chunks for t in c.choices[0].token_ids] == reference.tokens(ids, 6)
    with pytest.raises(openai.BadRequestError, match="skip-tokenizer-init"):
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="skip-tokenizer-init"):
        client.chat.completions.create(model=server.model, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])


# ---- (3) the prefix cache ----------------------------------------------------------------------

def test_second_request_reports_its_shared_prefix_as_cached_tokens(servers, reference):
    """Token-id prompts sharing 37 tokens (not a multiple of the 16-token page): the second
    request's usage says 37 cached, and its tokens are those of a plain prefill."""
    server = servers["ids"]
    client = _client(server)
    prefix = [(7 * i + 3) % 97 + 1 for i in range(37)]
    first = client.completions.create(model=server.model, prompt=prefix + [200, 201],
                                      max_tokens=3, temperature=0)
    second = client.completions.create(model=server.model, prompt=prefix + [202, 203, 204],
                                       max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 37
    assert second.choices[0].token_ids == reference.tokens(prefix + [202, 203, 204], 3)
    assert first.usage.prompt_tokens_details.cached_tokens < 37


def test_chat_turn_reuses_the_previous_turn(server):
    """The second turn's prompt starts with the first turn's prompt and answer: at least
    the first turn's prompt comes from the cache."""
    client = _client(server)
    messages = [{"role": "user", "content": "Name three prime numbers, please."}]
    one = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                         temperature=0)
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "And three more?"}]
    two = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4,
                                         temperature=0)
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 1


# ---- (4) the profiler window (SGLang's /start_profile, /stop_profile) -------------------------

def _profile_files(server: Server, start: dict, timeout_s: float = 60.0) -> tuple[str, list]:
    """-> rank 0's ops table and trace events once the window's files are written."""
    stem = Path(start["output_dir"]) / f"{start['name']}-rank0"
    table = stem.with_name(stem.name + ".txt")
    deadline = time.monotonic() + timeout_s
    while not table.exists():
        assert time.monotonic() < deadline, server.stderr()[-2000:]
        time.sleep(0.1)
    trace = stem.with_name(stem.name + ".trace.json.gz")
    return table.read_text(), json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


def test_profile_window_of_num_steps_writes_a_trace_of_those_steps(server, tmp_path):
    r = httpx.post(f"{server.url}/start_profile", timeout=30,
                   json={"output_dir": str(tmp_path), "num_steps": 3})
    assert r.status_code == 200, r.text
    start = r.json()
    assert start["status"] == "started" and start["num_steps"] == 3
    out = _client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                             temperature=0)
    assert out.usage.completion_tokens == 5
    table, events = _profile_files(server, start)
    steps = [e["name"] for e in events if e.get("name", "").startswith("cpmoe step ")]
    assert [s.split()[-1] for s in steps if not s.endswith(" idle")] == [
        "prefill", "decode", "decode"], steps
    assert table.startswith("3 steps\n")
    assert f"profile of 3 steps written to {tmp_path}" in server.stderr()


def test_stop_profile_closes_an_open_window(server, tmp_path):
    start = httpx.post(f"{server.url}/start_profile", json={"output_dir": str(tmp_path)},
                       timeout=30).json()
    assert start["num_steps"] is None
    _client(server).completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                       temperature=0)
    r = httpx.post(f"{server.url}/stop_profile", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "stopping"
    table, events = _profile_files(server, start)
    assert int(table.split()[0]) >= 2  # the request's prefill and decode, maybe more
    assert any(e.get("name", "").endswith(" prefill") for e in events)


@pytest.mark.parametrize("body,field", [
    ({"num_steps": 0}, "num_steps"), ({"num_steps": "3"}, "num_steps"),
    ({"activities": ["TPU"]}, "activities"), ({"activities": []}, "activities"),
    ({"num_step": 3}, "num_step")])
def test_bad_start_profile_gets_one_400_naming_the_field(server, body, field):
    r = httpx.post(f"{server.url}/start_profile", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    r = httpx.post(f"{server.url}/start_profile", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
