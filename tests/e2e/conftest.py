"""Fixtures shared by e2e modules.

demo_sampled_generate: the tokens `cpmoe generate` samples on the demo layout (tp 4, attn-cp
2, ep 4) for one prompt of the built-in model, run once per session: test_serve compares its
tp-4 server and test_serve_torchrun its two-node torchrun server against the same call (each
call is the CLI and its ranks' forkserver, each a torch import, and 4 ranks). The built-in
model is drawn from a fixed seed, so every cache folder holds the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_LAYOUT = ("--tp-size", "4", "--attn-cp-size", "2", "--moe-dp-size", "1", "--ep-size", "4")


@dataclass(frozen=True)
class SampledGenerate:
    prompt: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    tokens: list[int]  # what `cpmoe generate --json` printed for the prompt


@pytest.fixture(scope="session")
def demo_sampled_generate(tmp_path_factory, default_model_cache) -> SampledGenerate:
    call = SampledGenerate(prompt="Context parallel prefill", max_new_tokens=10,
                           temperature=0.8, top_p=0.9, top_k=20, seed=7, tokens=[])
    work = tmp_path_factory.mktemp("demo-generate")
    default_model_cache(work / "cache")  # the session's build (tests/conftest.py)
    prompts_file = work / "one.json"
    prompts_file.write_text(json.dumps([call.prompt]))
    cli = subprocess.run(
        [sys.executable, "-m", "cpmoe.cli", "generate", *DEMO_LAYOUT, "--device", "cpu",
         "--prompts-file", str(prompts_file), "--max-new-tokens", str(call.max_new_tokens),
         "--temperature", str(call.temperature), "--top-p", str(call.top_p), "--top-k",
         str(call.top_k), "--seed", str(call.seed), "--json"],
        capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT), check=False,
        env={**os.environ, "CPMOE_CACHE_DIR": str(work / "cache")})
    assert cli.returncode == 0, cli.stderr
    return SampledGenerate(**{**call.__dict__, "tokens": json.loads(cli.stdout)[0]["tokens"]})
