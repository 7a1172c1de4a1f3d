"""`cpmoe serve` end to end: the real server as a subprocess on 127.0.0.1, the built-in model.

Two servers start once for the module, concurrently: the demo layout (tp 4, attn-cp 2,
moe-dp 1, ep 4: five processes) and one rank with tight limits (max 1 running, queue of 4,
600 KV slots) for the admission tests. Tokens are compared with `cpmoe generate` for ONE
prompt: in this process through the engine (`Reference`) and once through the CLI itself.
The tp4 server is killed by the last test (a rank gets SIGKILL), so keep that test last.

The first tests check the pure parts (scheduler, detokenizer) without processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
from openai import OpenAI

from cpmoe.serve.detokenize import TextStream
from tests.e2e._serve_helpers import (  # noqa: F401 -- shared module fixtures
    Reference, Server, cache_dir, model_dir, ready_servers, reference, tokenizer)

TP4 = ("--tp-size", "4", "--attn-cp-size", "2", "--moe-dp-size", "1", "--ep-size", "4")
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7}
TP1_MAX_QUEUE = 4
PROMPTS = ["Context parallel prefill", "The quick brown fox jumps over the lazy dog. " * 3]


# ---- pure parts ---------------------------------------------------------------------------------

def test_text_stream_cuts_at_stop_and_never_splits_a_character(tokenizer):
    tok = tokenizer
    ids = tok.encode("ab€cd STOP ef")  # byte tokens: '€' is three of them
    whole = TextStream(tok)
    pieces = [whole.add(t) for t in ids] + [whole.finish()]
    assert "".join(pieces) == "ab€cd STOP ef"
    assert all("\ufffd" not in p for p in pieces)
    cut = TextStream(tok, ("STOP", "zz"))
    text = "".join(cut.add(t) for t in ids) + cut.finish()
    assert text == "ab€cd " and cut.stopped


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory, cache_dir, model_dir):
    """{"tp4": ..., "tp1": ...}, started together; stopped (if still up) at the end."""
    work = tmp_path_factory.mktemp("serve")
    started = {"tp4": Server(work, cache_dir, *TP4, "--max-total-tokens", "2048"),
               "tp1": Server(work, cache_dir, "--max-running", "1", "--max-queue",
                             str(TP1_MAX_QUEUE), "--max-total-tokens", "600")}
    yield from ready_servers(started)


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---- OpenAI client: outputs equal `cpmoe generate` ---------------------------------------------

def _concurrently(*calls: Callable[[], object]) -> list:
    """Run the calls in threads at once (so the server batches them); results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


@pytest.mark.parametrize("layout", ["tp4", "tp1"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, SAMPLED], ids=["greedy", "sampled"])
def test_openai_completions_match_generate(servers, reference, tokenizer, layout, sampling):
    server = servers[layout]
    client = _client(server)
    extra = {"return_token_ids": True, "top_k": sampling.get("top_k", 0)}
    args = {k: v for k, v in sampling.items() if k != "top_k"}
    calls = []
    for prompt in PROMPTS:
        kw = {"model": server.model, "prompt": prompt, "max_tokens": 12, "extra_body": extra,
              **args}
        calls += [partial(client.completions.create, **kw),
                  lambda kw=kw: list(client.completions.create(
                      **kw, stream=True, stream_options={"include_usage": True}))]
    results = _concurrently(*calls)
    for prompt, resp, chunks in zip(PROMPTS, results[::2], results[1::2]):
        want = reference.tokens(tokenizer.encode(prompt), 12, **sampling)
        choice = resp.choices[0]
        assert choice.token_ids == want, prompt
        assert choice.text == _decode(tokenizer, want)
        assert choice.finish_reason == ("stop" if want[-1] in reference.eos_ids else "length")
        assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert resp.usage.completion_tokens == len(want)
        assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == want
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert chunks[-1].usage.completion_tokens == len(want)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            choice.finish_reason


@pytest.mark.parametrize("layout", ["tp4", "tp1"])
def test_openai_chat_matches_generate_on_chat_template(servers, reference, tokenizer, layout):
    server = servers[layout]
    client = _client(server)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")  # the checkpoint's ChatML template
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    want = reference.tokens(prompt_ids, 10, **SAMPLED)
    args = {"model": server.model, "messages": messages, "max_tokens": 10,
            "temperature": SAMPLED["temperature"], "top_p": SAMPLED["top_p"],
            "seed": SAMPLED["seed"],
            "extra_body": {"top_k": SAMPLED["top_k"], "return_token_ids": True}}
    resp, chunks = _concurrently(
        partial(client.chat.completions.create, **args),
        lambda: list(client.chat.completions.create(**args, stream=True)))
    assert resp.choices[0].token_ids == want
    assert resp.choices[0].message.content == _decode(tokenizer, want)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason


def test_served_tokens_equal_cli_generate_on_demo_layout(servers, demo_sampled_generate):
    want = demo_sampled_generate  # `cpmoe generate` on TP4 (tests/e2e/conftest.py)
    server = servers["tp4"]
    resp = _client(server).completions.create(
        model=server.model, prompt=want.prompt, max_tokens=want.max_new_tokens,
        temperature=want.temperature, top_p=want.top_p, seed=want.seed,
        extra_body={"top_k": want.top_k, "return_token_ids": True})
    assert resp.choices[0].token_ids == want.tokens


def test_stop_string_ends_text_before_it(servers, reference, tokenizer):
    server = servers["tp1"]
    prompt = PROMPTS[1]
    want = _decode(tokenizer, reference.tokens(tokenizer.encode(prompt), 24))
    stop = next(want[i:i + 2] for i in range(4, len(want) - 2)
                if "\ufffd" not in want[i:i + 2] and want[i:i + 2].strip())
    client = _client(server)
    resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=24,
                                     temperature=0, stop=[stop, "never-seen"])
    assert resp.choices[0].text == want[:want.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=24,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want[:want.index(stop)]
    assert server.wait_idle()["cpmoe_kv_slots_used{rank=\"0\"}"] == 0


# ---- load: 64 concurrent clients ------------------------------------------------------------

def _load_specs() -> list[dict]:
    """64 requests: prompt lengths 3..300, max_tokens 4..12, greedy and seeded sampling,
    streamed and not; 8 streams are closed after two chunks and 2 non-streamed requests
    abandoned after a second (both kinds long enough to still be running then)."""
    lengths = [3, 8, 21, 55, 130, 300]
    specs = []
    for i in range(64):
        text = (f"request {i % 16}: " + "abcdefghij klmnop qrstuv wxyz " * 12)
        specs.append({"prompt": text[:lengths[i % len(lengths)]],
                      "max_tokens": 4 + (i % 16) % 9, "stream": i % 2 == 0,
                      "temperature": 0.0 if i % 3 else 0.9, "seed": i % 16,
                      "cancel": i % 8 == 3, "abandon": i in (10, 42)})
    for s in specs:
        if s["cancel"] or s["abandon"]:
            s.update(max_tokens=200, temperature=0.0, stream=s["cancel"], ignore_eos=True)
    return specs


async def _one(client: httpx.AsyncClient, url: str, model: str, spec: dict) -> dict:
    body = {"model": model, "prompt": spec["prompt"], "max_tokens": spec["max_tokens"],
            "temperature": spec["temperature"], "seed": spec["seed"], "stream": spec["stream"],
            "return_token_ids": True, "ignore_eos": spec.get("ignore_eos", False)}
    if spec["abandon"]:  # the client gives up: its connection closes mid-request
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.post(url, json=body), timeout=1.0)
            raise AssertionError(f"request {spec} ended before it was abandoned")
        return {"id": None, "tokens": [], "done": False}
    if not spec["stream"]:
        r = await client.post(url, json=body)
        r.raise_for_status()
        data = r.json()
        return {"id": data["id"], "tokens": data["choices"][0]["token_ids"], "done": True}
    tokens, rid, done = [], None, False
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            tokens += chunk["choices"][0]["token_ids"]
            if spec["cancel"] and len(tokens) >= 2:
                break  # leaving the block closes the connection mid-stream
    return {"id": rid, "tokens": tokens, "done": done}


def test_64_concurrent_clients_get_their_tokens_and_kv_returns_to_zero(servers, reference,
                                                                       tokenizer):
    server = servers["tp4"]
    specs = _load_specs()
    before = server.metrics()
    log_before = len(server.stderr())

    async def run_all() -> list[dict]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_one(client, f"{server.url}/v1/completions",
                                               server.model, s) for s in specs))

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    took = time.monotonic() - t0
    for spec, res in zip(specs, results):
        if spec["abandon"]:
            continue
        # a prefix of the tokens is the same at any max_tokens: check only what came
        n = len(res["tokens"]) if spec["cancel"] else spec["max_tokens"]
        want = reference.tokens(tokenizer.encode(spec["prompt"]), n,
                                temperature=spec["temperature"], seed=spec["seed"])
        assert res["done"] != spec["cancel"] and res["tokens"] == want, spec
    ids = [r["id"] for s, r in zip(specs, results) if not s["abandon"]]
    assert len(set(ids)) == len(ids)  # none duplicated
    after = server.wait_idle()
    assert [v for k, v in after.items() if k.startswith("cpmoe_kv_slots_used{")] == [0.0] * 4
    cancelled = sum(s["cancel"] or s["abandon"] for s in specs)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    abandoned = sum(s["abandon"] for s in specs)
    assert delta['cpmoe_requests_total{endpoint="completions",status="200"}'] == \
        len(specs) - abandoned
    assert delta['cpmoe_requests_total{endpoint="completions",status="499"}'] == abandoned
    assert delta['cpmoe_requests_finished_total{reason="cancelled"}'] == cancelled
    finished = sum(delta.get(f'cpmoe_requests_finished_total{{reason="{r}"}}', 0)
                   for r in ("stop", "length"))
    assert finished == len(specs) - cancelled
    assert delta["cpmoe_time_to_first_token_seconds_count"] >= len(specs) - abandoned
    # every submitted choice had its intake (arrival -> submitted to the engine) timed
    assert delta["cpmoe_request_intake_seconds_count"] >= len(specs)
    assert delta["cpmoe_request_intake_seconds_sum"] > 0
    # the batch log (SGLang's lines) accounts for every prefilled prompt token, step by step
    logged = re.findall(r"Prefill batch\. #new-seq: (\d+), #new-token: (\d+)",
                        server.stderr()[log_before:])
    assert logged and sum(int(t) for _, t in logged) == \
        delta["cpmoe_prompt_tokens_computed_total"]
    assert sum(int(n) for n, _ in logged) >= len(specs) - abandoned
    print(f"64 clients: {took:.1f} s")


# ---- admission and malformed requests --------------------------------------------------------

BAD_REQUESTS = [  # (name, body (bytes: sent raw), param the error names)
    ("malformed-json", b'{"model": "m", "prompt": ', None),
    ("not-an-object", b"[1, 2]", None),
    ("wrong-type-temperature", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("wrong-type-max-tokens", {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ("wrong-type-stream", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("wrong-type-prompt", {"prompt": {"text": "hi"}}, "prompt"),
    ("empty-prompt", {"prompt": ""}, "prompt"),
    ("empty-id-prompt", {"prompt": []}, "prompt"),
    ("token-out-of-vocab", {"prompt": [1, 99999]}, "prompt"),
    ("empty-second-prompt", {"prompt": ["a", ""]}, "prompt"),
    ("temperature-too-high", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("top-p-zero", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("top-k-negative", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("max-tokens-zero", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("seed-negative", {"prompt": "hi", "seed": -1}, "seed"),
    ("n-zero", {"prompt": "hi", "n": 0}, "n"),
    ("empty-stop", {"prompt": "hi", "stop": [""]}, "stop"),
    ("never-fits-kv", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
]
BAD_CHAT = [
    ("empty-messages", {"messages": []}, "messages"),
    ("bad-role", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("missing-messages", {"max_tokens": 3}, "messages"),
]


def test_malformed_requests_get_400_and_server_keeps_serving(servers):
    server = servers["tp1"]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, cases in (("/v1/completions", BAD_REQUESTS), ("/v1/chat/completions",
                                                                  BAD_CHAT)):
            for name, body, param in cases:
                if isinstance(body, dict):
                    body = json.dumps({"model": server.model, **body}).encode()
                r = http.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (name, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, name
                assert err["type"] == "invalid_request_error" and err["message"], name
                assert err["param"] == param, (name, err)
        r = http.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = http.post("/v1/completions", json={"model": server.model, "prompt": "hi",
                                               "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert http.get("/health").json()["status"] == "ok"


def test_full_queue_gets_503_and_waiting_requests_run_after(servers, reference, tokenizer):
    server = servers["tp1"]  # --max-running 1 --max-queue 4
    body = {"model": server.model, "temperature": 0, "stream": True, "return_token_ids": True}
    prompts = [f"queued {i}" for i in range(TP1_MAX_QUEUE)]
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(httpx.Client(base_url=server.url, timeout=120))
        running = stack.enter_context(http.stream(
            "POST", "/v1/completions", json={**body, "prompt": "long one", "max_tokens": 500,
                                             "ignore_eos": True}))
        lines = running.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(line for line in lines if line.startswith("data: "))
        queued = [stack.enter_context(httpx.Client(base_url=server.url, timeout=120).stream(
            "POST", "/v1/completions", json={**body, "prompt": p, "max_tokens": 3}))
            for p in prompts]
        deadline = time.monotonic() + 30
        while server.metrics()["cpmoe_requests_waiting"] < TP1_MAX_QUEUE:
            assert time.monotonic() < deadline, "the requests never queued"
            time.sleep(0.05)
        r = http.post("/v1/completions", json={**body, "prompt": "x", "stream": False})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "queue_full"
        running.close()  # cancels the long request: the queued ones start
        got = [[t for line in q.iter_lines() if line.startswith("data: {")
                for t in json.loads(line[6:])["choices"][0]["token_ids"]] for q in queued]
    assert got == [reference.tokens(tokenizer.encode(p), 3) for p in prompts]
    assert server.wait_idle()['cpmoe_kv_slots_used{rank="0"}'] == 0


def test_prompt_logprobs_and_a_grammar_answer_on_tp4_equal_one_rank(servers):
    """Prompt logprobs score every prompt row of a CP-split extend (StepPlan.prompt_logits,
    gathered over the ranks); a grammar's mask applies on rank 0 only."""
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y", "z"]},
                                               "b": {"type": "integer", "minimum": 0,
                                                     "maximum": 999}},
              "required": ["a", "b"]}
    got = []
    for layout in ("tp4", "tp1"):
        client = _client(servers[layout])
        r = client.completions.create(model=servers[layout].model, prompt=PROMPTS[1],
                                      max_tokens=2, temperature=0, echo=True, logprobs=1)
        g = client.completions.create(
            model=servers[layout].model, prompt=PROMPTS[0], max_tokens=60, temperature=0,
            extra_body={"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "s", "schema": schema}}})
        got.append((r.choices[0].logprobs, g.choices[0].text))
    (tp4, text4), (tp1, text1) = got
    assert tp4.tokens == tp1.tokens and tp4.token_logprobs[0] is None
    assert tp4.token_logprobs[1:] == pytest.approx(tp1.token_logprobs[1:], abs=1e-5)
    assert text4 == text1 and set(json.loads(text4)) == {"a", "b"}


def test_sigterm_while_streaming_aborts_requests_and_exits_0_without_traceback(servers):
    """issue 44 item 4: a stream in progress and a request queued behind it (max 1 running)
    both end with finish_reason "abort" (the stream with its [DONE]); the server exits 0,
    logs one line for the stop and no traceback, and leaves no process behind."""
    server = servers["tp1"]
    pids = server.processes()
    assert len(pids) >= 2  # the server and its rank
    body = {"model": server.model, "prompt": "in flight", "max_tokens": 500,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            queued = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body,
                                 timeout=60)
            deadline = time.monotonic() + 30
            while server.metrics()["cpmoe_requests_waiting"] < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        late = queued.result()
    assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(30) == 0, server.stderr()
    err = server.stderr()
    assert "Traceback" not in err, err
    assert err.count("cpmoe: SIGTERM: stopping (2 running request(s) aborted)") == 1, err
    deadline = time.monotonic() + 15
    while server.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.processes() == []


# ---- failure: keep last (kills the tp4 server) ------------------------------------------------

def test_killed_rank_gives_503_and_prompt_nonzero_exit(servers):
    server = servers["tp4"]
    pids = server.health()["rank_pids"]
    assert len(pids) == 4
    body = {"model": server.model, "prompt": "in flight", "max_tokens": 400, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as inflight:
            lines = inflight.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            killed_at = time.monotonic()
            os.kill(pids[2], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest and "engine_down" in rest[-1] and "[DONE]" not in rest[-1]
        r = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
    try:
        code = server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server still running 30 s after the rank died:\n{server.stderr()}")
    exited_after = time.monotonic() - killed_at
    assert code == 1, server.stderr()
    assert "cpmoe: rank 2 died: exit code -9 (SIGKILL)" in server.stderr()
    assert exited_after < 15, f"exit took {exited_after:.1f} s"
    deadline = time.monotonic() + 10
    while server.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.processes() == []
