"""One torch thread for in-process runs of tiny models: OpenMP hand-offs cost more than tiny
matmuls save, badly so on a busy 2-core machine (a rank of a pool runs on one thread too)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
