"""Per-rank time by phase of one prefill (CUDA events around attention, MoE, collectives):
shows which phase differs between ranks when a multi-GPU layout scales less than expected.

    python3 bench/phase_times.py --layout "tp=2,cp=2,dp=2" --length 65536 --layers 12
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cpmoe.bench.spec import SHAPES, parse_layout  # noqa: E402
from cpmoe.engine.runner import ModelRunner  # noqa: E402
from cpmoe.models import qwen_moe  # noqa: E402
from cpmoe.parallel import comm  # noqa: E402
from cpmoe.parallel.groups import ProcessGroups  # noqa: E402
from cpmoe.parallel.launch import RankInfo, RankPool  # noqa: E402

SPANS: dict[str, list] = defaultdict(list)


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        SPANS[name].append((start, end))
        return out
    return wrapper


def phase_task(info: RankInfo, config: dict, layout, length: int) -> dict:
    attn = qwen_moe.QwenMoeAttention
    attn.forward = _timed("attention (incl. K/V gather)", attn.forward)
    block = qwen_moe.QwenMoeSparseBlock
    block.routed = _timed("moe routed", block.routed)
    for op in ("all_gather", "all_reduce", "all_to_all"):
        setattr(comm, op, _timed(f"comm {op}", getattr(comm, op)))
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner.from_config(config, groups, torch.bfloat16)
    seqs = [torch.randint(0, config["vocab_size"], (length,)).tolist()]
    runner.prefill(seqs, last_only=True)
    torch.cuda.synchronize()
    SPANS.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    runner.prefill(seqs, last_only=True)
    end.record()
    torch.cuda.synchronize()
    out = {name: sum(s.elapsed_time(e) for s, e in spans) for name, spans in SPANS.items()}
    out["total"] = start.elapsed_time(end)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="tp=2,cp=2,dp=2")
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--layers", type=int, default=12)
    a = p.parse_args()
    config = dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=a.layers)
    layout = parse_layout(a.layout).layout
    with RankPool(layout.world_size, "cuda", collective_timeout_s=600) as pool:
        per_rank = pool.run(phase_task, config, layout, a.length)
    print(f"== {a.layout} length {a.length} layers {a.layers} (ms, per rank)")
    for name in per_rank[0]:
        print(f"  {name:<32} " + "  ".join(f"{r.get(name, 0.0):9.1f}" for r in per_rank))


if __name__ == "__main__":
    main()
