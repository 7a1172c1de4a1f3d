"""`cpmoe serve` under requests that must be refused: the server stays responsive and the
refusal names the numbers. One real server (tp 2, attn-cp 2, ep 2 on CPU, the layout the
stall was found on) with `--context-length 4096`, started once for the module.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e._serve_helpers import Server

CONTEXT = 4096
LAYOUT = ("--tp-size", "2", "--attn-cp-size", "2", "--ep-size", "2")
HUGE_PROMPT_CHARS = 1_500_000  # byte-level tokenizer: ~2-3 s of tokenizing on a CPU core
HEALTH_EVERY_S = 0.2


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_cache) -> Server:
    work = tmp_path_factory.mktemp("serve-limits")
    cache = Path(tmp_path_factory.getbasetemp()) / "cpmoe-cache"
    default_model_cache(cache)  # the session's build (tests/conftest.py)
    s = Server(work, cache, *LAYOUT, "--context-length", str(CONTEXT))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _health_latencies(url: str, until) -> list[float]:
    """/health round trips, one every HEALTH_EVERY_S, until the `until` future is done.
    (A stall of the event loop delays the one in flight by the stall's length; on a
    saturated machine any process sees scheduling gaps, so the probes are spaced out.)"""
    out = []
    with httpx.Client(base_url=url, timeout=30) as http:
        while not until.done() or not out:
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            out.append(time.monotonic() - t0)
            time.sleep(HEALTH_EVERY_S)
    return out


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": 10**9},
    {"prompt": "hi", "max_tokens": 10**18},
    {"prompt": "x" * HUGE_PROMPT_CHARS, "max_tokens": 1},
], ids=["max_tokens-1e9", "max_tokens-1e18", "1.5M-char-prompt"])
def test_health_answers_within_1s_while_a_huge_request_is_refused(server, body):
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=server.url, timeout=120) as http:
        started = time.monotonic()
        refused = pool.submit(http.post, "/v1/completions", json={"model": server.model, **body})
        latencies = _health_latencies(server.url, refused)
        r = refused.result()
        took = time.monotonic() - started
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert max(latencies) < 1.0, (f"/health took {max(latencies):.2f} s while the request "
                                  f"was refused ({took:.2f} s)")


def test_prompt_plus_max_tokens_beyond_context_length_gets_400_naming_both(server):
    body = {"model": server.model, "prompt": [7] * (CONTEXT - 2), "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=300) as http:
        over = http.post("/v1/completions", json={**body, "max_tokens": 3})
        chat = http.post("/v1/chat/completions", json={
            "model": server.model, "messages": [{"role": "user", "content": "x" * CONTEXT}]})
        at_limit = http.post("/v1/completions", json={**body, "max_tokens": 2,
                                                      "ignore_eos": True})
    assert over.status_code == 400, over.text
    err = over.json()["error"]
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert err["message"] == (f"prompt of {CONTEXT - 2} tokens + max_tokens 3 = {CONTEXT + 1} "
                              f"tokens exceeds the context length of {CONTEXT} tokens")
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    assert f"the context length of {CONTEXT} tokens" in chat.json()["error"]["message"]
    assert at_limit.status_code == 200, at_limit.text
    usage = at_limit.json()["usage"]
    assert usage.pop("prompt_tokens_details")["cached_tokens"] <= CONTEXT - 3
    assert usage == {"prompt_tokens": CONTEXT - 2, "completion_tokens": 2,
                     "total_tokens": CONTEXT}
