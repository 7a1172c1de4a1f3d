"""The paged, CP-sharded KV cache's bookkeeping: pages, the owner rule, capacity, refusal."""

from __future__ import annotations

import random

import pytest
import torch

from cpmoe.cp.kv_cache import CacheFullError, PagedKVCache
from cpmoe.cp.kv_capacity import decode_fill, request_rank_tokens
from cpmoe.cp.split import CPSplit, rank_counts
from cpmoe.engine.generate import kv_slots_needed


def cache(pages: int = 8, page_size: int = 4, cp: int = 1, rank: int = 0) -> PagedKVCache:
    return PagedKVCache(2, pages, page_size, 1, 2, torch.float32, torch.device("cpu"), cp, rank)


def one_by_one(counts: list[int], n: int) -> list[int]:
    """The owner rule applied token by token (the reference of the closed form)."""
    counts = list(counts)
    for _ in range(n):
        counts[min(range(len(counts)), key=lambda r: (counts[r], r))] += 1
    return counts


def test_decode_fill_matches_the_rule_applied_token_by_token():
    rng = random.Random(0)
    for _ in range(2000):
        counts = [rng.randint(0, 30) for _ in range(rng.randint(1, 8))]
        n = rng.randint(0, 100)
        assert decode_fill(counts, n) == one_by_one(counts, n), (counts, n)


def test_rank_counts_match_the_split():
    rng = random.Random(1)
    for _ in range(500):
        n, cp = rng.randint(1, 200), rng.choice([1, 2, 3, 4, 8])
        for strategy in ("zigzag", "interleave"):
            split = CPSplit.build([n], cp, strategy)
            assert rank_counts(n, cp, strategy) == [c[0] for c in split.seq_counts]


def test_rotated_rank_counts_match_the_rotated_split():
    rng = random.Random(2)
    for _ in range(300):
        lens, cp = [rng.randint(1, 60) for _ in range(3)], rng.choice([2, 3, 4, 8])
        rots = [rng.randrange(cp) for _ in lens]
        for strategy in ("zigzag", "interleave"):
            split = CPSplit.build(lens, cp, strategy, rots)
            for b, (n, rot) in enumerate(zip(lens, rots)):
                assert rank_counts(n, cp, strategy, rot) == [c[b] for c in split.seq_counts]
            assert sorted(split.local_flat_index(0).tolist() + [
                i for r in range(1, cp) for i in split.local_flat_index(r).tolist()]) == list(
                range(sum(lens)))


def test_chunked_prompt_ends_as_balanced_as_one_piece():
    """Chunk by chunk the rotation hands the larger shares to emptier ranks: whatever the
    chunking, no rank ends more than a split's own spread above an even share (without the
    rotation a 7-token zigzag chunk on 2 ranks gives rank 1 four tokens every time)."""
    rng = random.Random(3)
    for _ in range(300):
        cp, strategy = rng.choice([2, 4, 8]), rng.choice(["zigzag", "interleave"])
        kv, n = cache(pages=4096, page_size=1, cp=cp), rng.randint(1, 2000)
        done = 0
        while done < n:
            chunk = min(n - done, rng.choice([1, 3, 7, 16, 64, rng.randint(1, 300)]))
            kv.extend(0, kv.new_counts(0, chunk, strategy))
            done += chunk
        slack = 2 if strategy == "zigzag" else 1
        assert max(kv.seqs[0].counts) <= -(-n // cp) + slack, (cp, strategy, kv.seqs[0].counts)


def test_request_bound_is_closed_form_and_exact_without_chunks():
    assert request_rank_tokens(37, 10, 4, "zigzag") == decode_fill(
        rank_counts(37, 4, "zigzag"), 9)
    # O(cp) whatever max_tokens is: a billion tokens costs nothing
    assert max(request_rank_tokens(100, 10**9, 2, "zigzag")) == (100 + 10**9 - 1 + 1) // 2
    # chunked: an upper bound of every possible chunking (shares + 2 per chunk on zigzag)
    bound = request_rank_tokens(1000, 1, 4, "zigzag", chunk=64)
    assert bound == [250 + 2 * 16] * 4
    assert kv_slots_needed([1000], 1, 4, "zigzag", 16, 64) == 288


def test_pages_are_reused_after_free_and_slots_follow_the_page_list():
    kv = cache(pages=4, page_size=4)
    a = kv.extend(0, [6])  # two pages
    b = kv.extend(1, [3])  # one page
    assert kv.rank_pages == [3] and kv.used == 12 and kv.tokens_stored == 9
    assert a == [0, 1, 2, 3, 4, 5] and b == [8, 9, 10]
    assert kv.block_table([0, 1]) == [[0, 1], [2, 0]]
    kv.free(0)
    c = kv.extend(2, [8])  # the freed pages come back, in order
    assert sorted({s // 4 for s in c}) == [0, 1] and kv.free_pages(0) == 1
    assert kv.local_slots(2).tolist() == c


def test_fragmented_pages_still_serve_a_long_sequence():
    kv = cache(pages=6, page_size=2)
    for key in range(6):
        kv.extend(key, [2])
    for key in (0, 2, 4):
        kv.free(key)
    slots = kv.extend(9, [6])  # three non-adjacent pages
    assert [s // 2 for s in slots[::2]] == kv.seqs[9].pages and len(set(kv.seqs[9].pages)) == 3
    with pytest.raises(CacheFullError, match="--max-total-tokens 12"):
        kv.extend(10, [1])


def test_refusal_is_all_or_nothing_and_names_the_flag():
    kv = cache(pages=2, page_size=4)
    kv.extend(0, [5])
    with pytest.raises(CacheFullError, match=r"sequence 1 needs 2 more pages .*--max-total-tokens"):
        kv.extend(1, [5])
    assert 1 not in kv.seqs and kv.rank_pages == [2] and kv.free_pages(0) == 0


def test_owner_rule_balances_shards_and_every_rank_mirrors_every_rank():
    ranks = [cache(pages=8, page_size=2, cp=3, rank=r) for r in range(3)]
    for kv in ranks:
        kv.extend(7, [4, 1, 2])
    for _ in range(9):
        slots = [kv.append_decode([7])[0] for kv in ranks]
        owners = [r for r, kv in enumerate(ranks) if slots[r] != kv.trash_slot]
        assert len(owners) == 1  # exactly one rank stores each new token
    assert ranks[0].seqs[7].counts == one_by_one([4, 1, 2], 9) == [6, 5, 5]
    for kv in ranks:  # the mirrored page use of every rank is what each rank really holds
        assert kv.rank_pages == [len(k.seqs[7].pages) for k in ranks] == [3, 3, 3]


def test_decode_pages_needed_counts_page_boundaries_on_the_owner():
    kv = cache(pages=8, page_size=2, cp=2)
    kv.extend(0, [2, 1])  # rank 1 owns the next token, its page has room
    kv.extend(1, [2, 2])  # rank 0 owns it, page-aligned: a new page
    assert kv.decode_owners([0, 1]) == [1, 0]
    assert kv.decode_pages_needed([0, 1]) == [1, 0]
