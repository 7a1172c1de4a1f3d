"""The scheduler's rules, with the KV cache's accounting and no forward: chunked prefill
next to decoding streams, admission by pages without head-of-line blocking, preemption."""

from __future__ import annotations

import torch

from cpmoe.cp.kv_cache import PagedKVCache
from cpmoe.engine.sampling import SamplingParams
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import Request, StepPlan

EOS = 0


def make(pages: int, page_size: int = 4, chunk: int = 8, max_running: int = 8, cp: int = 1
         ) -> Scheduler:
    kv = PagedKVCache(1, pages, page_size, 1, 1, torch.float32, torch.device("cpu"), cp, 0)
    return Scheduler(kv, "zigzag", chunk, max_running, (EOS,))


def req(rid: int, prompt_len: int, max_tokens: int = 3) -> Request:
    return Request(rid, [1 + rid] * prompt_len, SamplingParams(), max_tokens)


def run(s: Scheduler, plan: StepPlan, token: int = 5) -> list:
    """What the ranks do with a plan (cache side only), then record one token per row."""
    for rid in plan.free:
        s.kv.free(rid)
    if plan.decode:
        s.kv.append_decode([rid for rid, _ in plan.decode])
    for rid, ids, _ in plan.extend:
        s.kv.extend(rid, s.kv.new_counts(rid, len(ids), "zigzag"))
    return s.record(plan, [token] * len(s.sample_rows(plan)))


def test_a_long_prompt_is_chunked_while_running_requests_keep_decoding():
    s = make(pages=64, chunk=8)
    s.add(req(0, 3, max_tokens=10))
    run(s, s.plan())  # request 0 prefilled, first token sampled
    s.add(req(1, 20))
    chunks = []
    for _ in range(3):
        plan = s.plan()
        assert plan.decode == [(0, 5)]  # the stream decodes in every step of the prefill
        chunks.append([(rid, len(ids), start) for rid, ids, start in plan.extend])
        run(s, plan)
    assert chunks == [[(1, 8, 0)], [(1, 8, 8)], [(1, 4, 16)]]
    assert s.running[1].generated == 1 and s.running[0].generated == 4
    assert s.plan().decode == [(0, 5), (1, 5)]


def test_a_chunk_that_leaves_one_prompt_token_extends_it_rather_than_decoding():
    s = make(pages=64, chunk=8)
    s.add(req(0, 9))
    steps = []
    for _ in range(3):
        plan = s.plan()
        steps.append(([(rid, len(ids), start) for rid, ids, start in plan.extend], plan.decode))
        run(s, plan)
    assert steps == [([(0, 8, 0)], []), ([(0, 1, 8)], []), ([], [(0, 5)])]


def test_small_requests_are_not_blocked_behind_one_that_does_not_fit_yet():
    s = make(pages=6, page_size=4, chunk=64)
    s.add(req(0, 12, max_tokens=20))  # 3 pages
    run(s, s.plan())
    s.add(req(1, 16))  # 4 pages: not now
    s.add(req(2, 3))  # 1 page: fits
    plan = s.plan()
    assert [rid for rid, _, _ in plan.extend] == [2]
    assert [r.rid for r in s.waiting] == [1]  # keeps its place at the head


def test_admission_respects_max_running_requests():
    s = make(pages=64, max_running=2, chunk=64)
    for rid in range(3):
        s.add(req(rid, 2))
    plan = s.plan()
    assert [rid for rid, _, _ in plan.extend] == [0, 1] and len(s.waiting) == 1


def test_preemption_frees_the_newest_and_it_resumes_with_its_tokens():
    s = make(pages=4, page_size=2, chunk=64)
    for rid in range(3):
        s.add(req(rid, 2, max_tokens=6))
    run(s, s.plan())  # three prompts of one page each
    outputs: dict[int, list[int]] = {}
    preempted_once = False
    for step in range(40):
        plan = s.plan()
        if plan.empty and not s.has_work():
            break
        if s.preemptions and not preempted_once:
            preempted_once = True
            victim = plan.free[-1]
            assert victim == 2 and s.waiting[0].rid == 2  # the newest, back at the front
            assert s.waiting[0].output == [5]  # its tokens so far are kept
            assert s.waiting[0].cached == 0
        for ev in run(s, plan, token=6):
            outputs.setdefault(ev.rid, []).append(ev.token)
    assert preempted_once
    assert {rid: len(s) for rid, s in outputs.items()} == {0: 5, 1: 5, 2: 5}
    assert not s.kv.seqs and s.kv.rank_pages == [0]


def test_cancel_frees_a_running_request_at_the_next_step():
    s = make(pages=16)
    s.add(req(0, 5))
    run(s, s.plan())
    s.cancel(0)
    plan = s.plan()
    assert plan.free == [0] and not plan.decode
    run(s, plan)
    assert not s.kv.seqs and not s.has_work()


def test_eos_finishes_a_request_and_its_pages_are_freed_next_step():
    s = make(pages=16)
    s.add(req(0, 5, max_tokens=10))
    events = run(s, s.plan(), token=EOS)
    assert events[0].finish == "stop" and not s.running
    assert s.plan().free == [0]


def test_decode_graph_table_rewrites_a_request_stored_again_under_its_old_id() -> None:
    """The graphs' block table is updated incrementally. A row keeps its entries while its
    sequence only grows; a request preempted and re-admitted under the same id holds new
    pages (a new page list) and must be rewritten whole, not read through stale page ids."""
    from cpmoe.engine.cuda_graph import table_updates
    written: list = []
    a, b = [7, 3], [5]
    assert table_updates(written, [a, b]) == ([0, 0, 1], [0, 1, 0], [7, 3, 5])
    a.append(9)  # a grows by one page: only that entry is written
    assert table_updates(written, [a, b]) == ([0], [2], [9])
    again = [4, 8, 2]  # request a freed and stored again: same id, same page count
    assert table_updates(written, [again, b]) == ([0, 0, 0], [0, 1, 2], [4, 8, 2])
    assert table_updates(written, [b]) == ([0], [0], [5])  # another sequence in row 0


def test_requests_sharing_a_prompt_being_prefilled_wait_for_it_and_fork_it():
    """Three requests over one 40-token system prompt arrive together, with one unrelated
    request behind them: the first prefills the prompt, the other two wait (the unrelated
    one is admitted at once), and once the prompt is in the index both fork its 40 tokens
    and prefill only their own 4."""
    kv = PagedKVCache(1, 128, 4, 1, 1, torch.float32, torch.device("cpu"))
    s = Scheduler(kv, "zigzag", 256, 8, (EOS,), radix=True)
    system = list(range(100, 140))
    for rid in range(3):
        s.add(Request(rid, system + [7 + rid] * 4, SamplingParams(), 3))
    s.add(req(9, 6))
    plan = s.plan()
    assert [(rid, len(ids), start) for rid, ids, start in plan.extend] == [(0, 44, 0),
                                                                             (9, 6, 0)]
    run(s, plan)
    plan = s.plan()
    assert plan.fork == [(1, 0, 40), (2, 0, 40)]
    assert [(rid, len(ids), start) for rid, ids, start in plan.extend] == [(1, 4, 40),
                                                                             (2, 4, 40)]


def _model(s: Scheduler, plan: StepPlan, fed: list[int]) -> list[int]:
    """The 'device' side of a step: cache writes, then one token per sampled row, a function
    of the row's last input token and its position (token 0 is EOS). `fed`: the previous
    step's tokens, which placeholders -(i + 1) in the plan name."""
    for rid in plan.free:
        s.kv.free(rid)
    inputs = {}
    for rid, t in plan.decode:
        inputs[rid] = (fed[-t - 1] if t < 0 else t, s.kv.seqs[rid].length)
    if plan.decode:
        s.kv.append_decode([rid for rid, _ in plan.decode])
    for rid, ids, start in plan.extend:
        assert min(ids) >= 0, "a placeholder reached a prefill"
        s.kv.extend(rid, s.kv.new_counts(rid, len(ids), "zigzag"))
        inputs[rid] = (ids[-1], start + len(ids) - 1)
    return [(inputs[r.rid][0] * 31 + r.rid * 7 + inputs[r.rid][1]) % 23
            for r in s.sample_rows(plan)]


def _serve(overlap: bool) -> tuple[dict[int, list[int]], int]:
    """Seven requests (one ignores EOS) through a cache small enough to preempt; with
    overlap each step's tokens are resolved only after the next step was planned."""
    s = make(pages=14, page_size=2, chunk=6)
    for rid in range(7):
        r = req(rid, 2 + rid % 3, max_tokens=4 + 3 * rid)
        r.prompt = [1 + (rid * 5 + i) % 20 for i in range(len(r.prompt))]
        r.ignore_eos = rid == 3
        s.add(r)
    out: dict[int, list[int]] = {}
    in_flight, fed = None, []
    for _ in range(400):
        plan = s.plan()
        if plan.empty and not s.has_work() and in_flight is None:
            break
        tokens = _model(s, plan, fed)
        if not overlap:
            events = s.record(plan, tokens)
        else:
            rows = s.account(plan)
            events = s.resolve(*in_flight) if in_flight else []
            in_flight, fed = (rows, tokens), tokens
        for ev in events:
            out.setdefault(ev.rid, []).append(ev.token)
    assert not s.kv.seqs and s.kv.rank_pages == [0]
    return out, s.preemptions


def test_overlapped_steps_give_the_tokens_of_synchronous_steps():
    """Placeholders, an EOS that lands after the request's next row was planned (the row's
    token is dropped), max_tokens known without the token, preemption while a token is in
    flight: the same tokens per request, and every page back."""
    want, preempted = _serve(overlap=False)
    got, _ = _serve(overlap=True)
    assert got == want
    assert preempted > 0
    assert any(toks[-1] == EOS for toks in want.values())  # some finish by EOS
    assert any(len(toks) == 4 + 3 * rid and toks[-1] != EOS for rid, toks in want.items())


def test_a_request_at_max_tokens_is_not_decoded_while_its_last_token_is_in_flight():
    s = make(pages=16)
    s.add(req(0, 3, max_tokens=1))
    rows = s.account(s.plan())
    assert s.plan().decode == []  # its one token is in flight: known to be the last
    [ev] = s.resolve(rows, [5])
    assert ev.finish == "length" and not s.running


def test_a_request_preempted_with_its_token_in_flight_can_still_finish_by_it():
    s = make(pages=4, page_size=2, chunk=64)
    for rid in range(3):
        s.add(req(rid, 2, max_tokens=6))
    first = s.plan()
    _model(s, first, [])
    rows = s.account(first)  # three tokens in flight
    second = s.plan()  # three full pages, one free: the newest is preempted
    assert second.free == [2] and s.waiting[0].rid == 2
    assert second.decode == [(0, -1), (1, -2)]  # fed from the device
    events = s.resolve(rows, [5, 5, EOS])
    assert [(ev.rid, ev.finish) for ev in events] == [(0, None), (1, None), (2, "stop")]
    assert not s.waiting and s.running.keys() == {0, 1}
