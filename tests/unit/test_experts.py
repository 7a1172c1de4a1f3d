"""The grouped-GEMM expert path (what runs on GPUs) against the per-expert loop reference,
on CPU where this torch has grouped_mm there."""

import pytest
import torch

from cpmoe.moe import experts as ex


def _grouped_mm_on_cpu() -> bool:
    try:
        x = torch.ones(2, 16, dtype=torch.bfloat16)
        ex._grouped_mm(x, torch.ones(1, 16, 16, dtype=torch.bfloat16),
                       offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@pytest.mark.skipif(ex._grouped_mm is None or not _grouped_mm_on_cpu(),
                    reason="this torch has no CPU grouped_mm")
@pytest.mark.parametrize("ep_size", [1, 2])
def test_grouped_path_matches_loop(ep_size: int) -> None:
    torch.manual_seed(0)
    E, H, inter, M, K = 8, 64, 32, 300, 4
    m = ex.LocalExperts(E, H, inter, torch.float32, shard=(0, ep_size, 0, 1))
    torch.nn.init.normal_(m.gate_up_proj, std=0.1)
    torch.nn.init.normal_(m.down_proj, std=0.1)
    x = torch.randn(M, H)
    low = -1 if ep_size > 1 else 0  # -1: an expert of another EP rank
    ids = torch.randint(low, E, (M, K))
    w = torch.rand(M, K)
    want = m._forward_loop(x, ids, w)
    mb = m.to(torch.bfloat16)
    got = mb._forward_grouped(x.bfloat16(), ids, w).float()
    assert got.shape == want.shape
    rel = (got - want).norm() / want.norm()
    assert rel < 2e-2, rel
    if ep_size > 1:  # a rank none of whose experts was picked returns zeros
        none = mb._forward_grouped(x.bfloat16(), torch.full((M, K), -1), w)
        assert torch.count_nonzero(none) == 0


@pytest.mark.parametrize("E", [8, 300])
@pytest.mark.parametrize("ep_size", [1, 2])
@pytest.mark.parametrize("M", [5, 2000])
def test_sorted_slots_is_the_int64_sort_of_the_ids(E: int, ep_size: int, M: int) -> None:
    """sorted_slots sorts narrow keys (uint8 with -1 wrapped to 255 past every expert, or
    int32): the same stable order, offsets and ranks as sorting the int64 ids with -1 as E."""
    torch.manual_seed(E + M)
    K = 4
    m = ex.LocalExperts(E, 8, 8, torch.float32, shard=(0, ep_size, 0, 1))
    ids = torch.randint(-1, E, (M, K))
    rows, offs, n, rank = m.sorted_slots(ids)
    key = torch.where(ids >= 0, ids, E).flatten()
    sorted_key, order = torch.sort(key, stable=True)
    want_offs = torch.searchsorted(sorted_key, torch.arange(1, E + 1))
    want_n = int(want_offs[-1]) if ep_size > 1 and M * K > ex._SYNC_MIN_SLOTS else M * K
    want_rank = torch.empty_like(order)
    want_rank[order] = torch.arange(M * K)
    assert n == want_n and torch.equal(offs, want_offs) and offs.dtype == torch.int64
    assert torch.equal(rows, order[:n] // K)
    assert torch.equal(rank, want_rank.view(M, K).clamp(max=n - 1))
