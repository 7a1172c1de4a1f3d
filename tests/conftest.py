"""Shared fixtures: tiny random HF Qwen3-MoE / Qwen2-MoE checkpoints written by transformers.

Session-scoped and built once (about a second each). Weights are float32 with a fixed seed;
the routers are scaled so top-k routing is decisive (no near-ties that fp32 rounding of a
different layout could flip), norms are perturbed away from 1 and the Qwen2 qkv biases are
random, so a loader that swaps or drops any of them is caught by value checks.

Fixtures:
    qwen3_moe_dir, qwen2_moe_dir   checkpoint directories (config.json + model.safetensors)
    hf_models                      {"qwen3_moe": model, "qwen2_moe": model}, eval mode
    make_hf_checkpoint             factory(kind, **config_overrides) -> (model, dir), cached
    pools                          pools(world) -> the session's live RankPool of that size
    default_model_cache            seed(cache_dir) -> the built-in model copied into cache_dir

The `full` marker: cases of exhaustive matrices beyond the representative set the default run
keeps (the suite's budget is 15 minutes on 2 cores). They are collected and reported as
skipped; `CPMOE_FULL=1 pytest` runs everything, `pytest -m full` only those cases.
tests/_full.py: `full_matrix(cases, keep)` marks the cases `keep` does not keep.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # cpmoe importable from the repo root without install
    sys.path.insert(0, str(REPO_ROOT))

# OpenMP threads that wait for work sleep instead of spinning: in this process (set before
# torch loads OpenMP) and in every process the tests start (CLI calls, their ranks, servers),
# which inherit it. The suite keeps both cores busy with several processes at once, and a
# spinning thread takes the core its partner needs: a 1-rank `cpmoe check` (two threads)
# took 16.9 CPU-s and 472 s spinning, 5.2 CPU-s and 53 s passive on this loaded machine.
# A value set by the caller is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests._threads import one_torch_thread  # noqa: E402

from tests._full import REASON, full_run  # noqa: E402

ROUTER_SCALE = 4.0

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             num_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
             tie_word_embeddings=False)

CONFIGS = {
    "qwen3_moe": dict(_BASE, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(_BASE, shared_expert_intermediate_size=48, decoder_sparse_step=1,
                      mlp_only_layers=[2], qkv_bias=True),
}
SEEDS = {"qwen3_moe": 0, "qwen2_moe": 1}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"full: a case of an exhaustive matrix beyond the "
                                       f"default representative set ({REASON})")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if full_run(config):
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)


def make_hf_model(kind: str, out_dir: pathlib.Path | None = None, **overrides):
    """-> (HF model in eval mode, checkpoint dir or None). Deterministic for (kind, overrides).

    With out_dir, the model is written there by `save_pretrained` (hub per-expert names)."""
    from transformers import (Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    cfg_cls, model_cls = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                          "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}[kind]
    torch.manual_seed(SEEDS[kind])
    model = model_cls(cfg_cls(**{**CONFIGS[kind], **overrides})).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("_proj.bias"):
                p.copy_(0.1 * torch.randn_like(p))
    if out_dir is not None:
        out_dir = pathlib.Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out_dir))
    return model, out_dir


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_session():
    """The whole run on one torch thread in the test process (tests/_threads.py says why):
    every in-process model run here is tiny, and on a 2-core machine busy with ranks and CLI
    subprocesses a second OpenMP thread mostly waits for its turn (a test module on HF
    parity took 27 CPU-s with two threads, 13 with one)."""
    with one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def _back_to_one_torch_thread():
    """After each test, one thread again: an in-process 1-rank `launch` (cpmoe.cli.main)
    gives the process its share of the machine's CPUs."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """The module's tests on one torch thread (tests/_threads.py says why); the whole run
    already is (_one_torch_thread_per_session), this keeps a module explicit about it."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def make_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """factory(kind, **config_overrides) -> (hf_model, dir); one build per distinct call."""
    cache: dict[tuple, tuple] = {}

    def make(kind: str, **overrides):
        key = (kind, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = make_hf_model(kind, tmp_path_factory.mktemp(kind), **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def qwen3_moe_dir(make_hf_checkpoint) -> pathlib.Path:
    return make_hf_checkpoint("qwen3_moe")[1]


@pytest.fixture(scope="session")
def qwen2_moe_dir(make_hf_checkpoint) -> pathlib.Path:
    return make_hf_checkpoint("qwen2_moe")[1]


@pytest.fixture(scope="session")
def hf_models(make_hf_checkpoint) -> dict:
    """kind -> the HF model whose weights are in that kind's checkpoint dir (eval mode)."""
    return {kind: make_hf_checkpoint(kind)[0] for kind in CONFIGS}


# the slowest task (the V4 4K-token cache test on 4 ranks of 2 cores) waits minutes for peers
COLLECTIVE_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def pools():
    """One rank pool per world size for the whole run (on cpu its ranks are forks of this
    process's forkserver, which imported torch once: a pool starts in about a second, where
    an interpreter and a torch import per rank took half a minute for the 2-, 4- and 8-rank
    pools on a 2-core machine), so every module that runs tasks on ranks (tests/distributed, and
    e2e ones) asks `pools(world)` and gets the same live pool; a pool that died (a failed task
    kills it) is replaced on the next call. Idle ranks wait on a pipe (no CPU).
    test_launch.py's tests that kill or close a pool make their own.
    Every task is followed by `destroy_subgroups` (tests/_groups.py): the groups a test's
    task built would otherwise stay in the ranks, each polling, for the rest of the run."""
    from cpmoe.parallel.launch import RankPool
    from tests._groups import destroy_subgroups

    class SessionPool(RankPool):
        def run(self, fn, *args, **kwargs):
            out = super().run(fn, *args, **kwargs)
            super().run(destroy_subgroups)
            return out

    live: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in live or not live[world].alive:
            live[world] = SessionPool(world, "cpu", collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        return live[world]

    yield get
    for pool in live.values():
        pool.close()


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    """seed(cache_dir) -> the built-in model's folder inside cache_dir (a CPMOE_CACHE_DIR),
    copied from one build per run: building it is about 3 CPU-s (integer draws for every
    weight, a tokenizer), copying its 7 MB a few ms, and modules keep their own cache
    folders. Its weights come from a fixed seed: a copy is what a build there would write.
    A test of building itself (test_default_model, the first-use demo) builds on its own."""
    from cpmoe.default_model import ensure_default_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPMOE_CACHE_DIR", str(tmp_path_factory.mktemp("default-model")))
        built = ensure_default_model()

    def seed(cache_dir: pathlib.Path) -> pathlib.Path:
        target = pathlib.Path(cache_dir) / built.name
        if not target.exists():
            shutil.copytree(built, target)
        return target

    return seed
