"""How unevenly do routed slots fall on EP ranks, and what would balance them? One GPU.

Records every MoE layer's slots per expert for two random prompts of one length (a
calibration prompt and the measured one) on the random-weight model of a shape, then
simulates, on the measured prompt's counts, the busiest EP rank's load over the mean
(summed over layers as a layer's time follows its busiest rank):
  static          experts [r*E/ep, (r+1)*E/ep) on rank r
  placed          experts placed by the calibration load (moe/placement.py)
  pool K          the K experts hottest in calibration held by every EP rank, each batch's
                  slots of them split so the ranks' loads even out (water-filling); the
                  others placed by the calibration load

    python3 -m bench.expert_load --lengths 16384,65536 --ep 2
"""

from __future__ import annotations

import argparse

import torch

from cpmoe.bench.model_task import prompts
from cpmoe.bench.spec import SHAPES
from cpmoe.engine.runner import ModelRunner
from cpmoe.moe import placement as pl
from cpmoe.parallel.groups import ProcessGroups


def layer_loads(runner: ModelRunner, seqs: list[list[int]]) -> torch.Tensor:
    runner.record_expert_load()
    runner.prefill(seqs, last_only=True)
    blocks = pl.layers_with_placement(runner.model)
    loads = torch.stack([b.placement.load for b in blocks]).double().cpu()
    for b in blocks:
        b.placement.load = None
    return loads  # [layers, E]


def busiest_over_mean(measured: torch.Tensor, calib: torch.Tensor, ep: int, pool: int,
                      placed: bool) -> float:
    total_max, total_mean = 0.0, 0.0
    for c, c_cal in zip(measured, calib):
        order = torch.argsort(-c_cal)
        hot, rest = order[:pool], order[pool:].sort().values
        p2l = rest[pl.balanced_placement(c_cal[rest], ep)] if placed else rest
        loads = pl.rank_loads(c, p2l, ep)
        level = float(loads.sum() + c[hot].sum()) / ep
        total_max += max(float(loads.max()), level)
        total_mean += level
    return total_max / total_mean


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--lengths", default="16384,65536")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runner = ModelRunner.from_config(SHAPES[a.shape], ProcessGroups.single(device),
                                     torch.bfloat16 if device.type == "cuda" else torch.float32,
                                     seed=a.seed)
    for length in map(int, a.lengths.split(",")):
        report(runner, a, length)


def report(runner: ModelRunner, a: argparse.Namespace, length: int) -> None:
    vocab = runner.config.vocab_size
    calib = layer_loads(runner, prompts(vocab, length, 1, a.seed + 1))
    measured = layer_loads(runner, prompts(vocab, length, 1, a.seed))
    share = (measured / measured.sum(1, keepdim=True)).sort(dim=1, descending=True).values
    print(f"{a.shape}, {length} tokens, ep {a.ep}: {measured.shape[0]} MoE layers")
    for k in (1, 4, 8, 16, 32):
        print(f"  hottest {k:>2} experts of a layer carry {float(share[:, :k].sum(1).mean()):.1%}"
              f" of its slots (mean over layers; uniform would be {k / share.shape[1]:.1%})")
    for name, placed in (("static", False), ("placed", True)):
        print(f"  {name}:  busiest rank / mean "
              f"{busiest_over_mean(measured, calib, a.ep, 0, placed):.3f}")
    for k in (2, 4, 8, 16, 32):
        if k >= share.shape[1] or (share.shape[1] - k) % a.ep:
            continue
        print(f"  pool {k:>2}: busiest rank / mean "
              f"{busiest_over_mean(measured, calib, a.ep, k, True):.3f} (placed rest), "
              f"{busiest_over_mean(measured, calib, a.ep, k, False):.3f} (static rest)")


if __name__ == "__main__":
    main()
