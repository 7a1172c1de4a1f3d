"""Packed dispatch rows carry ids and weights exactly, in every activation dtype."""

import pytest
import torch

from cpmoe.moe.dispatch.base import pack_rows, unpack_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip(dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 16).to(dtype)
    ids = torch.tensor([[0, 127, 255, 70000]] * 5) + torch.arange(5)[:, None]
    w = torch.rand(5, 4).to(dtype)
    packed = pack_rows(x, ids, w)
    assert packed.dtype == dtype and packed.shape[0] == 5
    x2, ids2, w2 = unpack_rows(packed, 16, 4)
    assert torch.equal(x2, x) and torch.equal(w2, w)
    assert ids2.dtype == torch.int64 and torch.equal(ids2, ids)
