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
                 dtype: torch.dtype) -> None:
        self.name, self.shape, self.seed = name, shape, seed
        self.device, self.dtype = device, dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _full(self) -> torch.Tensor:
        if self.name.endswith("norm.weight"):
            return torch.ones(self.shape, dtype=self.dtype, device=self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(self.name.encode()))
        t = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return t.normal_(0.0, 0.02, generator=gen).to(self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return self._full()[index]


class RandomCheckpoint:
    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.shapes, self.seed, self.device, self.dtype = shapes, seed, device, dtype

    def keys(self) -> list[str]:
        return list(self.shapes)

    def get_slice(self, name: str) -> _RandomTensor:
        return _RandomTensor(name, self.shapes[name], self.seed, self.device, self.dtype)
