"""DeepSeek-V4 decode caches sharded over CP ranks (gloo, float32, tiny V4 checkpoint).

A 4,096-token prompt on attn_cp 4 (tp 4, EP 4, interleave and zigzag), then greedy decode:
- every rank's cache bytes equal the size rule `sequence_bytes` (after the prefill and after
  the decode steps), and the busiest rank holds at most 1/4 of what one rank holds alone
  plus the sliding window, plus 5%;
- the greedy tokens equal the one-rank run's and every step's logits are within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from cpmoe.models.deepseek_v4.cache import sequence_bytes
from cpmoe.models.registry import load_model_config
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import ParallelLayout
from tests._threads import one_torch_thread
from tests.distributed._v4_tasks import cache_bytes_run, cache_bytes_task, make_v4_model

PROMPT, NEW_TOKENS, CP, TOL = 4096, 6, 4, 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_v4_model("base", tmp_path_factory.mktemp("v4_cache"))[1]


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def one_rank(model_dir, prompt) -> dict:
    with one_torch_thread():
        return cache_bytes_run(ProcessGroups.single(), model_dir, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def pool(pools):
    return pools(CP)


@pytest.mark.parametrize("strategy", ["interleave", "zigzag"])
def test_v4_cache_bytes_per_rank_are_a_quarter_on_attn_cp4(strategy, pool, model_dir, prompt,
                                                          one_rank):
    cfg = load_model_config(model_dir)[0]
    layout = ParallelLayout(tp_size=CP, attn_cp_size=CP, ep_size=CP, cp_strategy=strategy)
    got = pool.run(cache_bytes_task, layout, model_dir, prompt, NEW_TOKENS, timeout_s=900)
    one = sequence_bytes(cfg, PROMPT, 0, 1, 4)
    assert one_rank["prefill_bytes"] == sum(one.values())
    window = one["window"]
    for rank, res in enumerate(got):
        want = sequence_bytes(cfg, PROMPT, rank, CP, 4)
        assert res["prefill_bytes"] == sum(want.values()), f"rank {rank}"
        after = sequence_bytes(cfg, PROMPT + NEW_TOKENS - 1, rank, CP, 4)
        assert res["decode_bytes"] == sum(after.values()), f"rank {rank} after decode"
        bound = 1.05 * (one_rank["prefill_bytes"] / CP + window)
        assert res["prefill_bytes"] <= bound, (
            f"rank {rank}: {res['prefill_bytes']} bytes > 1/{CP} of {one_rank['prefill_bytes']}"
            f" + window {window} + 5%")
        assert res["tokens"] == one_rank["tokens"], f"rank {rank}: greedy tokens differ"
        diff = (res["steps"] - one_rank["steps"]).abs().max().item()
        assert diff <= TOL, f"rank {rank}: decode logits differ from one rank by {diff:.3e}"


def test_plan_states_the_v4_per_rank_cache_bytes(model_dir, capsys):
    # `plan` starts no process and reads no weight: cpmoe.cli.main in this process (a
    # subprocess was an interpreter and a torch import; test_cli runs `plan` as a command)
    import json

    from cpmoe.cli import main
    code = main(["plan", "--model", str(model_dir), "--tp-size", "4", "--attn-cp-size", "4",
                 "--ep-size", "4", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    note = json.loads(out.out)["decode_cache"]
    cfg = load_model_config(model_dir)[0]
    busiest = max(sum(sequence_bytes(cfg, 4096, r, 4, 4).values()) for r in range(4))
    assert "sharded over 4 CP rank(s)" in note
    assert f"{busiest} bytes on the busiest rank" in note
    assert f"{sum(sequence_bytes(cfg, 4096, 0, 1, 4).values())} on one rank" in note
