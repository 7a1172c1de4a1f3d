"""Expert placement by load: the greedy rule and the logical <-> physical maps."""

from __future__ import annotations

import pytest
import torch

from cpmoe.moe.placement import ExpertPlacement, balanced_placement, choose_placement, rank_loads


def test_balanced_placement_is_a_permutation_with_equal_expert_counts():
    torch.manual_seed(0)
    load = torch.randint(0, 1000, (128,))
    p2l = balanced_placement(load, 4)
    assert sorted(p2l.tolist()) == list(range(128))
    for r in range(4):  # each rank's experts in ascending logical order
        part = p2l[r * 32:(r + 1) * 32].tolist()
        assert part == sorted(part)


def test_balanced_placement_evens_a_skewed_load():
    # the fixed split puts every heavy expert on rank 0
    load = torch.tensor([100] * 8 + [1] * 8)
    identity = torch.arange(16)
    assert rank_loads(load, identity, 2).tolist() == [800, 8]
    assert rank_loads(load, balanced_placement(load, 2), 2).tolist() == [404, 404]


def test_placement_moves_nothing_unless_the_busiest_rank_gains():
    identity = torch.arange(16)
    assert torch.equal(choose_placement(torch.ones(16), identity, 4), identity)
    skewed = torch.tensor([9.0] * 4 + [1.0] * 12)
    assert not torch.equal(choose_placement(skewed, identity, 4), identity)


def test_balanced_placement_refuses_uneven_split():
    with pytest.raises(ValueError, match="do not split"):
        balanced_placement(torch.ones(10), 4)


def test_route_maps_logical_to_physical_and_counts_logical_load():
    p = ExpertPlacement(4)
    ids = torch.tensor([[0, 3], [3, 1]])
    assert torch.equal(p.route(ids), ids)  # identity until set
    p.set(torch.tensor([3, 1, 0, 2]))  # slot 0 holds expert 3, ...
    assert not p.identity
    assert p.route(ids).tolist() == [[2, 0], [0, 1]]
    p.load = torch.zeros(4, dtype=torch.int64)
    p.route(ids)
    assert p.load.tolist() == [1, 1, 0, 2]
