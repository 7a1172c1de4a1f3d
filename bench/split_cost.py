"""Host-side cost of one prefill's CP metadata (CPSplit.build + query runs) per CPU thread
count, on a process that has initialised CUDA (what a GPU rank does before its first kernel).

    python3 -m bench.split_cost --length 65536 --cp 2
"""

from __future__ import annotations

import argparse
import time

import torch

from cpmoe.cp.attention import query_runs
from cpmoe.cp.split import CPSplit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--threads", default="1,2,4,8,16,32")
    a = p.parse_args()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
    for threads in map(int, a.threads.split(",")):
        torch.set_num_threads(threads)
        took = []
        for _ in range(5):
            t = time.perf_counter()
            split = CPSplit.build([a.length], a.cp, "zigzag")
            query_runs(split.local_positions(0), split.local_token_to_seq(0))
            took.append(time.perf_counter() - t)
        print(f"threads {threads:3d}: best {min(took) * 1e3:7.2f} ms  worst "
              f"{max(took) * 1e3:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
