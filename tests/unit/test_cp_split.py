"""Tests for cpmoe.cp.split: block assignment, coverage, and the all-gather round trip."""

from __future__ import annotations

import time

import pytest
import torch

from cpmoe.cp.split import STRATEGIES, CPSplit, split_positions


def _lists(parts: list[torch.Tensor]) -> list[list[int]]:
    return [p.tolist() for p in parts]


# ---- hand-worked examples -------------------------------------------------------------


@pytest.mark.parametrize(
    "length, cp, strategy, expected",
    [
        (8, 2, "zigzag", [[0, 1, 6, 7], [2, 3, 4, 5]]),
        # blocks of sizes 3,3,2,2: [0,1,2] [3,4,5] [6,7] [8,9]
        (10, 2, "zigzag", [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]),
        # cp=4: 8 blocks of 2; rank r keeps blocks r and 7-r
        (16, 4, "zigzag", [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
        # L < 2cp: blocks of size 1,1,1,0 -> rank0 blocks 0,3 = [0]; rank1 blocks 1,2 = [1,2]
        (3, 2, "zigzag", [[0], [1, 2]]),
        # L=1, cp=4: only block 0 is non-empty
        (1, 4, "zigzag", [[0], [], [], []]),
        (5, 2, "interleave", [[0, 2, 4], [1, 3]]),
        (2, 4, "interleave", [[0], [1], [], []]),
        (5, 1, "zigzag", [[0, 1, 2, 3, 4]]),
    ],
)
def test_worked_examples(length: int, cp: int, strategy: str, expected: list[list[int]]) -> None:
    parts = split_positions(length, cp, strategy)
    assert all(p.dtype == torch.int64 for p in parts)
    assert _lists(parts) == expected
    split = CPSplit.build([length], cp, strategy)
    assert [split.local_positions(r).tolist() for r in range(cp)] == expected
    assert split.counts == tuple(len(e) for e in expected)


def test_worked_batch_example() -> None:
    # seqs of length 4 and 3, zigzag cp=2: seq0 -> r0 [0,3] r1 [1,2]; seq1 -> r0 [0] r1 [1,2]
    s = CPSplit.build([4, 3], 2, "zigzag")
    assert s.cu_seqlens == (0, 4, 7)
    assert s.local_positions(0).tolist() == [0, 3, 0]
    assert s.local_token_to_seq(0).tolist() == [0, 0, 1]
    assert s.local_flat_index(0).tolist() == [0, 3, 4]
    assert s.local_positions(1).tolist() == [1, 2, 1, 2]
    assert s.local_flat_index(1).tolist() == [1, 2, 5, 6]
    assert s.counts == (3, 4) and s.max_count == 4
    assert s.seq_counts == ((2, 1), (2, 2))
    # rank0 rows 0..2 (row 3 padding), rank1 rows 4..7
    assert s.gathered_to_flat().tolist() == [0, 4, 5, 1, 2, 6, 7]


# ---- coverage and ordering ----------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_every_position_on_exactly_one_rank(strategy: str, cp: int) -> None:
    for length in range(1, 41):
        parts = split_positions(length, cp, strategy)
        assert len(parts) == cp
        for p in parts:  # sorted, strictly increasing
            assert bool((p[1:] > p[:-1]).all())
        assert sorted(torch.cat(parts).tolist()) == list(range(length))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1, (length, sizes)  # both strategies balance tokens


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_batch_of_uneven_lengths(strategy: str, cp: int) -> None:
    seq_lens = [1, 7, 2, 16, 33, 3, 5, 64]
    s = CPSplit.build(seq_lens, cp, strategy)
    total = sum(seq_lens)
    assert s.cu_seqlens[0] == 0 and s.cu_seqlens[-1] == total and len(s.cu_seqlens) == 9
    seen = []
    for r in range(cp):
        flat = s.local_flat_index(r)
        pos, sid = s.local_positions(r), s.local_token_to_seq(r)
        assert flat.shape == pos.shape == sid.shape == (s.counts[r],)
        assert bool((flat[1:] > flat[:-1]).all())  # local order = flat order restricted
        # local tokens match split_positions of each sequence, in batch order
        want_pos = [split_positions(L, cp, strategy)[r] for L in seq_lens]
        assert pos.tolist() == torch.cat(want_pos).tolist()
        assert flat.tolist() == (torch.tensor(s.cu_seqlens[:-1])[sid] + pos).tolist()
        seen += flat.tolist()
    assert sorted(seen) == list(range(total))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_counts_and_seq_counts_consistent(strategy: str) -> None:
    seq_lens = [9, 1, 30, 4, 17]
    for cp in (1, 2, 4, 8):
        s = CPSplit.build(seq_lens, cp, strategy)
        assert len(s.counts) == cp and len(s.seq_counts) == cp
        assert all(len(row) == len(seq_lens) for row in s.seq_counts)
        assert tuple(sum(row) for row in s.seq_counts) == s.counts
        for b, L in enumerate(seq_lens):
            assert sum(s.seq_counts[r][b] for r in range(cp)) == L
            for r in range(cp):
                assert s.seq_counts[r][b] == len(split_positions(L, cp, strategy)[r])
        assert s.max_count == max(1, max(s.counts))


def test_rank_with_zero_tokens() -> None:
    s = CPSplit.build([1], 8, "zigzag")
    assert s.counts == (1, 0, 0, 0, 0, 0, 0, 0) and s.max_count == 1
    assert s.local_flat_index(5).shape == (0,)
    assert s.scatter(torch.ones(1, 3), 5).shape == (0, 3)
    assert s.pad_local(torch.empty(0, 3)).shape == (1, 3)


# ---- the all-gather round trip ------------------------------------------------------


def _roundtrip(s: CPSplit, x: torch.Tensor) -> torch.Tensor:
    padded = []
    for r in range(s.cp_size):
        local = s.scatter(x, r)
        assert local.shape[0] == s.counts[r]
        p = s.pad_local(local)
        assert p.shape == (s.max_count, *x.shape[1:])
        assert bool((p[s.counts[r] :] == 0).all())
        padded.append(p)
    return s.unpermute(torch.cat(padded))  # what all_gather_into_tensor produces


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_scatter_pad_gather_unpermute_is_identity(strategy: str, cp: int) -> None:
    g = torch.Generator().manual_seed(cp)
    for seq_lens in ([1], [5], [2, 3], [40, 1, 17, 8], [100, 3, 64]):
        s = CPSplit.build(seq_lens, cp, strategy)
        x = torch.randn(sum(seq_lens), 3, 2, generator=g)
        assert torch.equal(_roundtrip(s, x), x)
        xi = torch.randint(0, 1000, (sum(seq_lens),), generator=g)  # 1-D, integer dtype
        assert torch.equal(_roundtrip(s, xi), xi)
        # gathered_to_flat points into each rank's occupied slab
        g2f = s.gathered_to_flat()
        rank, slot = g2f // s.max_count, g2f % s.max_count
        assert bool((slot < torch.tensor(s.counts)[rank]).all())
        assert len(set(g2f.tolist())) == len(g2f)


def test_cp1_is_identity() -> None:
    seq_lens = [7, 3, 12]
    for strategy in STRATEGIES:
        s = CPSplit.build(seq_lens, 1, strategy)
        total = sum(seq_lens)
        assert s.counts == (total,) and s.max_count == total
        assert torch.equal(s.local_flat_index(0), torch.arange(total))
        assert torch.equal(s.gathered_to_flat(), torch.arange(total))
        x = torch.randn(total, 4)
        assert torch.equal(s.scatter(x, 0), x)
        assert torch.equal(s.pad_local(x), x)
        assert torch.equal(s.unpermute(x), x)
        assert s.local_positions(0).tolist() == [p for L in seq_lens for p in range(L)]


def test_accessors_return_copies() -> None:
    s = CPSplit.build([10], 2, "zigzag")
    s.local_flat_index(0).zero_()
    s.gathered_to_flat().zero_()
    s.local_positions(0).zero_()
    assert s.local_flat_index(0).tolist() == [0, 1, 2, 8, 9]
    assert s.local_positions(0).tolist() == [0, 1, 2, 8, 9]
    assert s.gathered_to_flat().tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 3, 4]


# ---- causal balance -----------------------------------------------------------------


def _causal_work(length: int, cp: int, strategy: str) -> list[int]:
    return [int((p + 1).sum()) for p in split_positions(length, cp, strategy)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp: int) -> None:
    for k in (1, 2, 3, 16):  # L divisible by 2cp: work is exactly equal
        work = _causal_work(2 * cp * k, cp, "zigzag")
        assert max(work) == min(work), work
    for length in range(2 * cp, 200):  # otherwise the leftover tokens skew it by < 2L
        work = _causal_work(length, cp, "zigzag")
        assert max(work) - min(work) <= 2 * length, (length, work)
    # and strictly better than contiguous chunks for a long sequence
    length = 4096
    chunk = [int((c + 1).sum()) for c in torch.arange(length).chunk(cp)]
    zig = _causal_work(length, cp, "zigzag")
    assert max(zig) - min(zig) < (max(chunk) - min(chunk)) // 100


# ---- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq_lens, cp, strategy, match",
    [
        ([], 2, "zigzag", "empty batch"),
        ([3, 0], 2, "zigzag", "sequence 1 has length 0"),
        ([3, -2], 2, "zigzag", "sequence 1"),
        ([2.5], 2, "zigzag", "sequence 0"),
        ([4], 0, "zigzag", "cp_size"),
        ([4], -1, "interleave", "cp_size"),
        ([4], 2, "ring", "zigzag, interleave"),
    ],
)
def test_bad_input_errors(seq_lens: list, cp: int, strategy: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPSplit.build(seq_lens, cp, strategy)


def test_bad_use_errors() -> None:
    s = CPSplit.build([5, 3], 2, "zigzag")
    with pytest.raises(ValueError, match="split_positions|length"):
        split_positions(0, 2, "zigzag")
    with pytest.raises(ValueError, match="cp_rank"):
        s.local_flat_index(2)
    with pytest.raises(ValueError, match="expected total"):
        s.scatter(torch.zeros(7, 2), 0)
    with pytest.raises(ValueError, match="max_count"):
        s.pad_local(torch.zeros(s.max_count + 1, 2))
    with pytest.raises(ValueError, match="cp_size\\*max_count"):
        s.unpermute(torch.zeros(s.max_count, 2))


def test_split_is_hashable_and_comparable() -> None:
    a, b = CPSplit.build([5, 3], 2, "zigzag"), CPSplit.build((5, 3), 2, "zigzag")
    assert a == b and hash(a) == hash(b)
    assert a != CPSplit.build([5, 3], 2, "interleave")


def test_large_build_runs() -> None:
    # Performance is reported, not asserted; this just exercises the 256K-token path.
    t0 = time.perf_counter()
    s = CPSplit.build([262144], 8, "zigzag")
    elapsed = time.perf_counter() - t0
    print(f"build([262144], cp=8, zigzag): {elapsed * 1e3:.1f} ms")
    assert s.counts == (32768,) * 8
    assert torch.equal(s.gathered_to_flat().sort().values, torch.arange(262144))
