"""Structured output, tool calls and the sampling fields of issue 47 through the real `openai`
client, against one CPU server on the built-in model (random weights: the grammar does all the
work) started with `--tool-call-parser qwen25 --reasoning-parser qwen3`.

References are independent of the server: outputs are checked with `json` + `jsonschema` and
`re`; tokens against `cpmoe generate` in this process (`Reference`); prompt logprobs against
log_softmax of HF transformers' logits for the prompt (float32).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI

from tests.e2e._serve_helpers import (  # noqa: F401 -- shared module fixtures
    REPO_ROOT, Reference, Server, cache_dir, model_dir, ready_servers, reference, tokenizer)

PROMPT = "Context parallel prefill"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "langs": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1,
              "maxItems": 3},
    "admin": {"type": "boolean"},
    "address": {"type": "object", "properties": {"zip": {"type": "string",
                                                         "pattern": "^[0-9]{5}$"}},
                "required": ["zip"]}},
    "required": ["name", "age", "langs", "admin", "address"]}
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "days", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
             "required": ["tz"]}}}]
ARGS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir, model_dir):
    work = tmp_path_factory.mktemp("serve-structured")
    started = {"s": Server(work, cache_dir, "--max-total-tokens", "8192",
                           "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")}
    running = ready_servers(started)
    yield next(running)["s"]
    running.close()  # stops it


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                   "strict": True}}


# ---- JSON schema, json_object, regex, ebnf ---------------------------------------------------

def test_json_schema_output_parses_and_validates_on_every_sample(server):
    client = _client(server)
    resp = client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=200, temperature=1.0, seed=3, n=4,
        response_format=_schema_format(PERSON))
    texts = [c.message.content for c in resp.choices]
    stream = client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=200, temperature=1.0, seed=4,
        response_format=_schema_format(PERSON), stream=True)
    texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    done = client.completions.create(  # completions too (vLLM's and SGLang's extension)
        model=server.model, prompt=PROMPT, max_tokens=200, temperature=0,
        extra_body={"response_format": _schema_format(PERSON)})
    texts.append(done.choices[0].text)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert all(c.finish_reason == "stop" for c in resp.choices)
    assert len(set(texts[:4])) > 1  # sampled: the grammar constrains, the seed still chooses


def test_json_object_regex_and_ebnf_outputs_match_them(server):
    client = _client(server)
    obj = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=100,
                                         temperature=0.7, seed=1,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = r"(ab|cd)[0-9]{3}-[x-z]+\."
    for seed in range(3):
        r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=60,
                                      temperature=1.0, seed=seed, extra_body={"regex": regex})
        assert re.fullmatch(regex, r.choices[0].text), r.choices[0].text
    ebnf = 'root ::= "answer: " ("yes" | "no") ("!" | "")'
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=20,
                                       temperature=1.0, seed=5, extra_body={"ebnf": ebnf})
    assert re.fullmatch(r"answer: (yes|no)!?", r.choices[0].message.content)


def test_rows_with_and_without_a_grammar_in_one_batch_keep_their_tokens(server, reference,
                                                                        tokenizer):
    client = _client(server)
    want = reference.tokens(tokenizer.encode(PROMPT), 24)

    def plain():
        return client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                         temperature=0,
                                         extra_body={"return_token_ids": True,
                                                     "ignore_eos": True})

    def constrained():
        return client.completions.create(
            model=server.model, prompt="x " * 20, max_tokens=200, temperature=0,
            extra_body={"response_format": _schema_format(PERSON)})

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(f) for f in (constrained, plain, constrained, plain)]
        results = [f.result() for f in futures]
    for r in results[1::2]:
        assert r.choices[0].token_ids == want
    for r in results[::2]:
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)


# ---- tool calls --------------------------------------------------------------------------------

def _check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), ARGS[name])


def test_required_tool_call_parses_into_the_declared_arguments_streamed_and_not(server):
    client = _client(server)
    for seed in range(2):
        resp = client.chat.completions.create(
            model=server.model, messages=ASK, max_tokens=300, temperature=1.0, seed=seed,
            tools=TOOLS, tool_choice="required")
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _check_call(call.function.name, call.function.arguments, set(ARGS))
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=server.model, messages=ASK, max_tokens=300, temperature=1.0, seed=7,
            tools=TOOLS, tool_choice="required", stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:  # as the openai client accumulates them
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
            assert d.id is None or d.id.startswith("call_")
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        _check_call(entry["name"], entry["arguments"], set(ARGS))


def test_named_function_is_the_one_call_and_auto_leaves_text_as_content(server):
    client = _client(server)
    resp = client.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=300, temperature=1.0, seed=2,
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = resp.choices[0].message.tool_calls
    assert len(calls) == 1
    _check_call(calls[0].function.name, calls[0].function.arguments, {"get_time"})
    auto = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=8,
                                          temperature=0, tools=TOOLS, tool_choice="auto")
    message = auto.choices[0].message
    assert message.tool_calls is None and auto.choices[0].finish_reason in ("stop", "length")
    assert message.content  # random weights write no <tool_call>: the text is content


# ---- sampling fields ---------------------------------------------------------------------------

def test_logit_bias_of_100_makes_every_token_that_token(server, tokenizer):
    client = _client(server)
    token = tokenizer.encode("Q")[0]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 9, "top_p": 0.9}):
        r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                      logit_bias={str(token): 100}, **sampling,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].token_ids == [token] * 12
        assert r.choices[0].text == "Q" * 12


def test_stop_token_ids_end_the_answer_before_that_token(server, reference, tokenizer):
    client = _client(server)
    free = reference.tokens(tokenizer.encode(PROMPT), 16)
    eos = set(reference.eos_ids)
    at = next(i for i, t in enumerate(free) if i >= 3 and t not in eos and t not in free[:i])
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                  temperature=0, extra_body={"stop_token_ids": [free[at]],
                                                             "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.token_ids == free[:at + 1]  # the stop token in the ids, as EOS is
    assert choice.text == tokenizer.decode(free[:at], skip_special_tokens=True)


def test_min_p_of_1_samples_the_greedy_tokens(server, reference, tokenizer):
    r = _client(server).completions.create(
        model=server.model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5,
        extra_body={"min_p": 1.0, "return_token_ids": True})
    assert r.choices[0].token_ids == reference.tokens(tokenizer.encode(PROMPT), 10)


def test_prompt_logprobs_have_one_entry_per_prompt_token_equal_to_hf_log_softmax(
        server, model_dir, tokenizer):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    want = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    client = _client(server)
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                  temperature=0, echo=True, logprobs=2)
    got = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert len(got.tokens) == len(ids) + 3
    assert got.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    for i in range(1, len(ids)):
        best = torch.topk(lp[i - 1], 2)
        assert list(got.top_logprobs[i].values()) == pytest.approx(best.values.tolist(),
                                                                   abs=1e-4)
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                            temperature=0, echo=True, logprobs=2,
                                            stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


# ---- bad values: one 400 naming the field ------------------------------------------------------

BAD = [  # (endpoint, body, param, words in the message)
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias", "999999"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids", "-1"),
    ("completions", {"min_p": 1.5}, "min_p", "1.5"),
    ("completions", {"regex": "a(b"}, "regex", "parenthesis"),
    ("completions", {"ebnf": "root ::= foo"}, "ebnf", "foo"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ("chat", {"response_format": _schema_format({"type": "strin"})}, "response_format",
     "strin"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "xml"),
    ("chat", {"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "one grammar"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "'f'"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}],
        "tool_choice": "required"}, "tools", "nowhere"),
]


@pytest.mark.parametrize("endpoint,body,param,words", BAD,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, p, _) in enumerate(BAD)])
def test_bad_structured_or_sampling_value_gets_one_400_naming_it(server, endpoint, body,
                                                                 param, words):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
            else {"prompt": "hi"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(f"{server.url}{path}", json={"model": server.model, "max_tokens": 4,
                                                 **base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "\n" not in err["message"]


# ---- bench-serving --json-schema -----------------------------------------------------------------

def _requests_served(url: str) -> int:
    import httpx
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("cpmoe_requests_total{"))


def test_bench_serving_json_schema_sends_it_with_every_request(server, tmp_path):
    """Each answer is `{"ok": true}` or `{"ok": false}` and EOS (13 or 14 tokens of the byte
    tokenizer): the schema reached the server with every request and ended it early. The two
    warm-up requests reach the server too but are not among the run's results."""
    schema = tmp_path / "ok.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"]}))
    out = tmp_path / "bench.json"
    before = _requests_served(server.url)
    run = subprocess.run(
        [sys.executable, "-m", "cpmoe.cli", "bench-serving", "--base-url", server.url,
         "--vocab-size", "256", "--num-prompts", "4", "--random-input-len", "8",
         "--random-output-len", "40", "--json-schema", str(schema), "--out", str(out),
         "--warmup-requests", "2"],
        capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT), check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 4 and result["summary"]["failed"] == 0
    assert {r["tokens"] for r in result["requests"]} <= {13, 14}
    assert result["header"]["json_schema"] == str(schema)
    assert result["header"]["warmup_requests"] == 2 and len(result["requests"]) == 4
    assert _requests_served(server.url) - before == 4 + 2
