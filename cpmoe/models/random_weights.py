"""Seeded random weights that stand in for a checkpoint (benchmarks at real shapes).

`RandomCheckpoint` looks like an open safetensors file to the loader (`keys()`,
`get_slice(name)` with `get_shape()` and slicing), so a random model is sharded by exactly
the rules that shard a real one. Every full tensor is drawn from a generator seeded by
(seed, tensor name) on the target device: the same name gives the same values on every
rank and every layout, so layouts can be compared on random weights too.
"""

from __future__ import annotations

import zlib

import torch


class _RandomTensor:
    def __init__(self, name: str, shape: tuple[int, ...], seed: int, device: torch.device,
                 dtype: torch.dtype, int_high: int | None = None) -> None:
        self.name, self.shape, self.seed = name, shape, seed
        self.device, self.dtype, self.int_high = device, dtype, int_high

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _full(self) -> torch.Tensor:
        if self.name.endswith("norm.weight"):
            return torch.ones(self.shape, dtype=self.dtype, device=self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(self.name.encode()))
        if self.int_high is not None:  # [rows, k] ids, distinct within a row, in [0, high)
            rows, k = self.shape
            keys = torch.rand(rows, self.int_high, generator=gen, device=self.device)
            return keys.argsort(dim=1)[:, :k].contiguous()
        t = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return t.normal_(0.0, 0.02, generator=gen).to(self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return self._full()[index]


class RandomCheckpoint:
    """int_ranges: integer tensors (e.g. hash-routing tables) and the bound of their ids."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, device: torch.device,
                 dtype: torch.dtype, int_ranges: dict[str, int] | None = None) -> None:
        self.shapes, self.seed, self.device, self.dtype = shapes, seed, device, dtype
        self.int_ranges = int_ranges or {}

    @classmethod
    def of(cls, model_cls: type, cfg, seed: int, device: torch.device,
           dtype: torch.dtype) -> "RandomCheckpoint":
        """The random checkpoint of a model class at a config (`checkpoint_shapes`, and
        `checkpoint_int_ranges` where the model has integer tensors)."""
        return cls(model_cls.checkpoint_shapes(cfg), seed, device, dtype,
                   model_cls.checkpoint_int_ranges(cfg))

    def keys(self) -> list[str]:
        return list(self.shapes)

    def get_slice(self, name: str) -> _RandomTensor:
        return _RandomTensor(name, self.shapes[name], self.seed, self.device, self.dtype,
                             self.int_ranges.get(name))


def one_rank_checkpoint_shapes(model_cls: type, cfg) -> dict[str, tuple[int, ...]]:
    """Tensor names and full shapes of a checkpoint in the model's own (HF) parameter names,
    read off the one-rank model built on the meta device; fused experts become the hub's
    per-expert `experts.<e>.{gate,up,down}_proj.weight` tensors the loader expects."""
    from cpmoe.moe.experts import LocalExperts
    from cpmoe.parallel.groups import ProcessGroups
    from cpmoe.parallel.layout import ParallelLayout
    with torch.device("meta"):
        model = model_cls(cfg, ProcessGroups.offline(ParallelLayout(), 0, "meta"),
                          torch.bfloat16)
    modules = dict(model.named_modules())
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        prefix, _, attr = name.rpartition(".")
        experts = modules.get(prefix)
        if not isinstance(experts, LocalExperts):
            shapes[name] = tuple(param.shape)
            continue
        E, H, inter = experts.down_proj.shape
        for e in range(E):
            if attr == "down_proj":
                shapes[f"{prefix}.{e}.down_proj.weight"] = (H, inter)
            else:
                shapes[f"{prefix}.{e}.gate_proj.weight"] = (inter, H)
                shapes[f"{prefix}.{e}.up_proj.weight"] = (inter, H)
    return shapes
