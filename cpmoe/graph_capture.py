"""CUDA graph capture shared by the decode graphs of every model (the engine's paged ones,
engine/cuda_graph.py, and DeepSeek-V4's, models/deepseek_v4/graph.py): the batch-size
buckets a graph is captured for, and one capture (a warm-up run, then the captured run).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_bs (and max_bs itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
    return sorted(set(sizes))


def capture(forward: Callable[[], torch.Tensor], device: torch.device, pool
            ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output) of `forward`, captured into memory pool `pool` (None: a new one)
    after one eager warm-up run on a side stream (kernels compiled, collectives initialised)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out
