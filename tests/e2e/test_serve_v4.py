"""`cpmoe serve` of a tiny DeepSeek-V4 (the CP tests' float32 checkpoint, no tokenizer:
token ids in and out) on two ranks (tp 2 = attn-cp 2, ep 2), prompts chunked 64 tokens a
step.

- Mixed long and short prompts sent at once (300, 150 and 200 tokens next to 1-40: long
  ones are prefilled in chunks while short ones decode next to them) return, each, the
  greedy tokens `cpmoe generate` gives for that prompt alone on one rank (whole prefill);
- a request whose prompt and max_tokens need more token slots than the cache holds is
  refused with one line before it runs: V4's books count every token on every rank, so
  the check uses the whole length (with the tokens split over the 2 CP ranks it would have
  been admitted and met a full cache mid-run);
- the server keeps serving after it.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.distributed._v4_tasks import make_v4_model
from tests.e2e._serve_helpers import Reference, Server, ready_servers

LAYOUT = ("--tp-size", "2", "--attn-cp-size", "2", "--ep-size", "2")
CAPACITY = 800  # every prompt of the mixed test at once: 710 + 7 x 8 tokens
LENGTHS = [300, 7, 150, 1, 40, 200, 12]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    return make_v4_model("base", tmp_path_factory.mktemp("v4_serve"))[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, v4_dir):
    work = tmp_path_factory.mktemp("serve_v4")
    started = {"v4": Server(work, work, "--model", str(v4_dir), *LAYOUT,
                            "--skip-tokenizer-init", "--chunked-prefill-size", "64", "--max-total-tokens",
                            str(CAPACITY), "--context-length", "1024")}
    for servers in ready_servers(started):
        yield servers["v4"]


def _complete(server: Server, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=300,
                      json={"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True})


def test_mixed_long_and_short_prompts_give_the_generate_tokens(server, v4_dir):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: _complete(server, p, MAX_TOKENS), prompts))
    ref = Reference(v4_dir, ())
    for n, p, r in zip(LENGTHS, prompts, replies):
        assert r.status_code == 200, f"{r.text}\nserver log:\n{server.stderr()[-4000:]}"
        got = r.json()["choices"][0]["token_ids"]
        assert got == ref.tokens(p, MAX_TOKENS), f"the {n}-token prompt"


def test_a_request_past_the_v4_cache_is_refused_in_one_line(server):
    r = _complete(server, [3] * 600, 250)  # 849 slots: over 800, under 2 x 800
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    need = re.search(r"needs (\d+) KV slots", msg)
    assert need and int(need[1]) >= 849 and f"--max-total-tokens {CAPACITY}" in msg, msg
    assert "\n" not in msg
    ok = _complete(server, [5] * 20, 3)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
