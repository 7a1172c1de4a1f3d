"""Engine steps. The overlap schedule (engine.py, scheduler.py): steps fed on the device by
the previous step's tokens and resolved on the host one step late give the tokens of steps
run one after another, through `generate` (an EOS landing after the request's next row was
planned included) and through `bench-one-batch`'s decode loop. The prefill warm-up before
the first request leaves the cache as it found it."""

from __future__ import annotations

import pytest
import torch

from cpmoe.bench.one_batch import _decode_overlapped, _decode_synced
from cpmoe.engine import engine
from cpmoe.engine.options import EngineOptions
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.parallel.groups import ProcessGroups

CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64,
              hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
              max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False)
OPTS = dict(page_size=4, chunked_prefill_size=16)


def _runner() -> ModelRunner:
    return ModelRunner.from_config(CONFIG, ProcessGroups.single(), torch.float32, seed=3)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, 64, (5 + 9 * i,), generator=gen).tolist() for i in range(4)]


def test_generate_overlapped_equals_synced_steps(monkeypatch):
    runner, prompts = _runner(), _prompts()
    free_run = generate(runner, prompts, 12, options=EngineOptions(**OPTS))
    eos = free_run[1][4]  # an EOS that ends prompt 1 (at least) mid-run
    synced = generate(runner, prompts, 12, (eos,),
                      options=EngineOptions(**OPTS, disable_overlap_schedule=True))
    overlapped: list[bool] = []
    step = engine.run_step

    def spy(runner, plan, sched, *rest):
        overlapped.append(plan.overlap)
        return step(runner, plan, sched, *rest)

    monkeypatch.setattr(engine, "run_step", spy)
    got = generate(runner, prompts, 12, (eos,), options=EngineOptions(**OPTS))
    assert got == synced
    assert any(len(t) < 12 and t[-1] == eos for t in synced)
    assert sum(overlapped) >= 10  # the decode steps ran overlapped
    assert runner.kv.used == 0


def test_bench_decode_overlapped_equals_synced():
    runner, prompts = _runner(), _prompts()
    runner.allocate_kv(1024, 4)
    keys = list(range(len(prompts)))
    out = []
    for decode in (_decode_synced, _decode_overlapped):
        first = runner.extend([Segment(k, p) for k, p in zip(keys, prompts)]).argmax(-1)
        out.append(decode(runner, keys, first, first.tolist(), 6))
        for k in keys:
            runner.kv.free(k)
    (want, _), (got, times) = out
    assert got == want and len(got) == 7 and len(times) == 6


@pytest.mark.parametrize("chunk, slots, extends", [
    (100, 512, [[(100, 0)], [(16, 100)], [(32, 116)], [(64, 148)]]),
    # a ladder of powers of two under the chunk: every expert tile variant of a served step
    # of up to a chunk (at Qwen3-30B-A3B's 128 experts x top-8, fused_moe's 32 and 64-row
    # tiles from 256 and 512 tokens, the grouped FP8 GEMM's 64-row tiles from 1,024)
    (400, 2048, [[(400, 0)], [(16, 400)], [(32, 416)], [(64, 448)], [(128, 512)],
                 [(256, 640)]]),
    # the ladder stops where the sequence would pass the model's 1,024 positions
    (1000, 1200, [[(600, 0)], [(16, 600)], [(32, 616)], [(64, 648)], [(128, 712)]])])
def test_prefill_warm_up_runs_a_chunk_and_cached_prefix_extends_and_frees_them(
        monkeypatch, chunk, slots, extends):
    from cpmoe.engine.options import warm_up_prefill
    runner = _runner()
    runner.allocate_kv(slots, 4)
    seen = []
    extend = runner.extend
    monkeypatch.setattr(runner, "extend", lambda segs: seen.append(
        [(len(s.ids), s.start) for s in segs]) or extend(segs))
    warm_up_prefill(runner, chunk)
    assert seen == extends
    assert not runner.kv.seqs and runner.kv.used == 0 and runner.times.prefill_s == 0


def test_sampled_and_penalised_rows_see_the_request_as_before_their_token():
    """Rows that sample or apply penalties are chosen on the host from the request as it was
    before the step: the first sampled token of prompt i is `sample` at stream i, step 0
    (the reference is the sampler on a plain prefill's logits), and a frequency penalty
    never sees a placeholder (it would index the vocabulary with a negative id)."""
    from cpmoe.engine.sampling import SamplingParams, sample
    runner, prompts = _runner(), _prompts()
    params = SamplingParams(temperature=0.9, seed=4)
    got = generate(runner, prompts, 3, sampling=params, options=EngineOptions(**OPTS))
    runner.kv = None
    logits = runner.prefill(prompts, last_only=True)
    assert [t[0] for t in got] == [sample(logits[i:i + 1], params, [i], 0)[0]
                                   for i in range(len(prompts))]
    penalised = SamplingParams(frequency_penalty=1.5)
    assert len(generate(runner, prompts, 6, sampling=penalised)[0]) == 6


def test_the_step_loop_runs_with_what_existed_before_it_out_of_the_collector(monkeypatch):
    """gc.freeze for the loop (a full collection walking the model is a pause in a step),
    gc.unfreeze after it: a rank pool's next task owns its objects again."""
    import gc
    runner, prompts = _runner(), _prompts()
    frozen: list[int] = []
    step = engine.run_step

    def spy(runner, plan, sched, *rest):
        frozen.append(gc.get_freeze_count())
        return step(runner, plan, sched, *rest)

    monkeypatch.setattr(engine, "run_step", spy)
    assert gc.get_freeze_count() == 0
    generate(runner, prompts, 4, options=EngineOptions(**OPTS))
    assert frozen and min(frozen) > 1000  # the model's objects, at least
    assert gc.get_freeze_count() == 0


def test_serving_warm_up_runs_a_batch_through_the_engine_loop_and_frees_it(monkeypatch):
    """The server's warm-up goes through the step loop a request takes (overlapped steps,
    sampling), prefix cache on, and leaves the cache as it found it: no sequence, no page
    held, nothing cached."""
    from cpmoe.engine.serving import WARM_UP_PROMPTS, WARM_UP_TOKENS, warm_up_serving
    runner = _runner()
    runner.allocate_kv(512, 4)
    plans = []
    step = engine.run_step

    def spy(runner, plan, sched, *rest):
        plans.append(plan)
        return step(runner, plan, sched, *rest)

    monkeypatch.setattr(engine, "run_step", spy)
    warm_up_serving(runner, EngineOptions(**OPTS))
    prefilled = sum(len(ids) for p in plans for _, ids, _ in p.extend)
    assert prefilled == sum(WARM_UP_PROMPTS)
    assert sum(len(p.decode) for p in plans) == len(WARM_UP_PROMPTS) * (WARM_UP_TOKENS - 1)
    assert any(p.overlap for p in plans)
    kv = runner.kv
    assert not kv.seqs and kv.used == 0 and kv.cached_pages == [0]
