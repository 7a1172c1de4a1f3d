"""The prefix cache's parts without a forward: the radix index, forking refcounted pages
on every CP rank, and the scheduler's hits, reporting and eviction before preemption."""

from __future__ import annotations

import random

import torch

from cpmoe.cp.kv_cache import PagedKVCache
from cpmoe.cp.split import CPSplit
from cpmoe.engine.radix import RadixIndex
from cpmoe.engine.sampling import SamplingParams
from cpmoe.engine.scheduler import Scheduler
from cpmoe.engine.request import Request
from tests.unit.test_scheduler import run


def test_index_finds_the_longest_shared_prefix_to_the_token():
    rng = random.Random(0)
    index = RadixIndex(page=4)
    entries = {k: [rng.randrange(3) for _ in range(rng.randint(1, 30))] for k in range(40)}
    for k, toks in entries.items():
        index.insert(k, toks, evictable=k % 2 == 0)
    for k in range(0, 40, 3):
        index.remove(k)
        del entries[k]
    for _ in range(300):
        query = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
        best = max((next((i for i, (a, b) in enumerate(zip(t, query)) if a != b),
                         min(len(t), len(query))) for t in entries.values()), default=0)
        key, n = index.match(query)
        assert n == best, (query, n, best)
        if n:
            assert entries[key][:n] == query[:n]
    assert index.evictable() == [k for k in index.lru]


def test_fork_shares_whole_pages_copies_the_partial_one_and_frees_by_reference():
    for strategy in ("zigzag", "interleave"):
        ranks = [PagedKVCache(1, 16, 4, 1, 1, torch.float32, torch.device("cpu"), 2, r,
                              strategy) for r in range(2)]
        for kv in ranks:
            kv.extend(0, [c[0] for c in CPSplit.build([21], 2, strategy).seq_counts])
            for layer in kv.k:
                layer[:16] = torch.arange(16.0)[:, None, None, None]  # page id in every slot
            kv.fork(1, 0, 13)
        counts = ranks[0].seqs[1].counts
        assert sum(counts) == 13 and ranks[1].seqs[1].counts == counts
        assert ranks[0].rank_pages == ranks[1].rank_pages  # every rank mirrors every rank
        for r, kv in enumerate(ranks):
            src, new = kv.seqs[0].rank_pages, kv.seqs[1].rank_pages
            full = counts[r] // 4
            assert new[r][:full] == src[r][:full]  # shared
            if counts[r] % 4:  # copied into a page of its own
                assert new[r][full] not in src[r]
                assert kv.k[0][new[r][full], :counts[r] % 4].eq(src[r][full]).all()
            assert kv.pages_freed([0]) == [len(p) - counts[q] // 4 for q, p in enumerate(src)]
            kv.free(0)
            kv.free(1)
            assert kv.rank_pages == [0, 0] and all(len(f) == 16 for f in kv._free)


def make(pages: int, radix: bool = True, policy: str = "fcfs", chunk: int = 64) -> Scheduler:
    kv = PagedKVCache(1, pages, 4, 1, 1, torch.float32, torch.device("cpu"), 1, 0)
    return Scheduler(kv, "zigzag", chunk, 8, (0,), radix=radix, policy=policy)


def req(rid: int, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, prompt, SamplingParams(), max_tokens)


def finish(s: Scheduler) -> list:
    events = []
    while s.running or s.waiting:
        plan = s.plan()
        for rid, src, n in plan.fork:
            s.kv.fork(rid, src, n)
        events += run(s, plan)
    return events


def test_second_request_forks_the_shared_prefix_and_reports_it():
    s = make(pages=32)
    prefix = list(range(1, 11))
    s.add(req(0, prefix + [20, 21]))
    finish(s)
    assert 0 in s.index.lru and 0 in s.kv.seqs  # kept as a cache entry
    s.add(req(1, prefix + [30]))
    plan = s.plan()
    assert plan.fork == [(1, 0, 10)] and plan.extend == [(1, [30], 10)]
    s.kv.fork(1, 0, 10)
    events = run(s, plan)
    events += finish(s)
    assert [e.cached_tokens for e in events if e.finish] == [10]
    s.add(req(2, prefix + [20, 21]))  # the same prompt: all but its last token
    assert s.plan().fork == [(2, 0, 11)]


def test_entries_are_evicted_lru_before_a_request_is_preempted():
    s = make(pages=6)
    for rid in range(3):  # three finished entries of one page each
        s.add(req(rid, [rid + 1] * 3, max_tokens=1))
        finish(s)
    assert list(s.index.lru) == [0, 1, 2]
    s.add(req(9, [7] * 16, max_tokens=2))  # 4 pages: the oldest entry goes
    plan = s.plan()
    assert plan.free == [0] and s.evictions == 1
    run(s, plan)
    plan = s.plan()  # its decode needs a fifth page: the next oldest goes, nobody preempted
    assert plan.free == [1] and plan.decode and s.evictions == 2 and s.preemptions == 0
    s.clear_cache()
    assert s.take_frees() == [2]


def test_lpm_admits_the_requests_with_the_longest_cached_prefix_first():
    prefix = list(range(1, 21))
    admitted = {}
    for policy in ("fcfs", "lpm"):
        s = make(pages=64, policy=policy, chunk=20)
        s.add(req(0, prefix + [40]))
        finish(s)
        s.add(req(1, [50] * 18))  # no cached prefix, arrived first: 18 tokens to prefill
        s.add(req(2, list(range(1, 9)) + [60]))  # 8 tokens cached, 1 to prefill
        s.add(req(3, prefix + [70, 71]))  # 20 tokens cached, 2 to prefill
        admitted[policy] = [rid for rid, _, _ in s.plan().extend]
    # a step of 20 tokens: arrival order fills it with 18 + 1 and request 3 waits; lpm takes
    # the two cached ones and request 1 waits for a step with room for all of it
    assert admitted == {"fcfs": [1, 2], "lpm": [3, 2]}


def test_lpm_keeps_arrival_order_past_the_fallback_queue_length():
    from cpmoe.engine.scheduler import LPM_MAX_WAITING
    s = make(pages=4096, policy="lpm", chunk=8)
    s.add(req(0, [1, 2, 3, 4, 5]))
    finish(s)
    for rid in range(1, LPM_MAX_WAITING + 2):  # one past the fallback length
        s.add(req(rid, [9, rid] if rid < LPM_MAX_WAITING + 1 else [1, 2, 3, 4, 7]))
    assert [rid for rid, _, _ in s.plan().extend][:2] == [1, 2]


def test_schedule_policy_is_an_engine_flag_and_refuses_unknown_ones(capsys):
    import pytest
    from cpmoe.cli import build_parser
    from cpmoe.cli.flags import engine_options
    parser = build_parser()
    assert engine_options(parser.parse_args(["serve"])).schedule_policy == "fcfs"
    args = parser.parse_args(["serve", "--schedule-policy", "lpm"])
    assert engine_options(args).schedule_policy == "lpm"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["serve", "--schedule-policy", "lof"])
    assert e.value.code == 2 and "--schedule-policy" in capsys.readouterr().err
    with pytest.raises(ValueError, match="schedule policy"):
        make(pages=8, policy="lof")


def test_without_radix_finished_requests_are_freed():
    s = make(pages=8, radix=False)
    s.add(req(0, [1, 2, 3], max_tokens=1))
    finish(s)
    assert s.index is None and s.plan().free == [0]


def test_disable_radix_cache_is_an_engine_flag_of_generate_check_and_serve():
    from cpmoe.cli import build_parser
    from cpmoe.cli.flags import engine_options
    parser = build_parser()
    for command in ("generate", "check", "serve"):
        extra = ["--prompt", "x"] if command == "generate" else []
        on = engine_options(parser.parse_args([command, *extra]))
        off = engine_options(parser.parse_args([command, *extra, "--disable-radix-cache"]))
        assert (on.disable_radix_cache, off.disable_radix_cache) == (False, True), command


def test_cached_pages_count_what_only_finished_entries_hold():
    kv = PagedKVCache(1, 16, 4, 1, 1, torch.float32, torch.device("cpu"), 1, 0)
    kv.extend(0, [10])  # 3 pages
    kv.fork(1, 0, 9)  # shares 2, copies 1
    kv.mark_cached(0)
    assert kv.cached_pages == [1]  # only page 2 of sequence 0 is held by the entry alone
    kv.free(1)
    assert kv.cached_pages == [3] and kv.rank_pages == [3]
    kv.fork(2, 0, 8)
    assert kv.cached_pages == [1]
    kv.free(0)
    assert kv.cached_pages == [0] and kv.rank_pages == [2]
    kv.free(2)
    assert kv.rank_pages == [0] and kv.cached_pages == [0]


def test_an_entry_deeper_than_the_recursion_limit_is_indexed_matched_and_removed():
    """A 65,536-token prompt is 4,096 pages of 16: removing it once crashed the scheduler
    (RecursionError) on the H200."""
    import sys
    idx = RadixIndex(1)
    long = [i % 7 for i in range(sys.getrecursionlimit() + 500)]
    idx.insert(1, long)
    idx.insert(2, long[:100] + [9])
    assert idx.match(long + [3]) == (1, len(long))
    idx.remove(1)
    assert idx.match(long) == (2, 100) and len(idx.root.children) == 1
    idx.remove(2)
    assert not idx.root.children and not idx.root.tails
