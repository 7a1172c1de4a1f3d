"""Per-rank time by phase of one prefill (CUDA events around attention, MoE, collectives):
shows which phase differs between ranks when a multi-GPU layout scales less than expected.

    python3 -m bench.phase_times --layout "tp=2,cp=2,dp=2" --length 65536 --layers 12

--timeline N prints layer N's phases as start/end times on every rank, measured from one
instant the ranks share (a GPU all-reduce just before the prefill), so waits show where
they happen. --even-routing (an experiment) replaces the router's choice with a fixed one
that gives every expert the same number of slots: the MoE load a perfectly balanced expert
placement would see (logits are meaningless then); --balanced first places the experts by the
load of a calibration prefill on another prompt of the same length (what bench's
`placement=balanced` does).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from collections import defaultdict

import torch

from cpmoe.bench.spec import SHAPES, parse_layout
from cpmoe import communicator
from cpmoe.engine.runner import ModelRunner
from cpmoe.models.qwen_moe import model as qwen_moe
from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo, RankPool

SPANS: dict[str, list] = defaultdict(list)
LAYER = [-1]  # index of the layer being run, for the timeline


HOST: dict[str, float] = {}


def _host_mark(fn):
    def wrapper(self, *args, **kwargs):
        HOST.setdefault("first layer", time.perf_counter())
        LAYER[0] = self.layer
        return fn(self, *args, **kwargs)
    return wrapper


def _even_router(self, x_NH):
    N, K, E = x_NH.shape[0], self.top_k, self.weight.shape[0]
    slots = torch.arange(N * K, device=x_NH.device).view(N, K)
    ids = (slots * 7919) % E  # K distinct ids per row (7919 is prime, E a power of two)
    return ids, torch.full((N, K), 1.0 / K, dtype=x_NH.dtype, device=x_NH.device)


def _gc_watch(phase, info):
    if phase == "start":
        HOST["gc start"] = time.perf_counter()
    else:
        HOST["gc"] = HOST.get("gc", 0.0) + time.perf_counter() - HOST["gc start"]


def _timed(name, fn):
    def wrapper(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        SPANS[name].append((start, end, LAYER[0]))
        return out
    return wrapper


def phase_task(info: RankInfo, config: dict, layout, length: int, threads: int | None = None,
               cprofile: bool = False, timeline: int | None = None,
               even_routing: bool = False, balanced: bool = False) -> dict:
    if threads:
        torch.set_num_threads(threads)
    if even_routing:
        qwen_moe.SoftmaxTopKRouter.forward = _even_router
    qwen_moe.QwenMoeDecoderLayer.forward = _host_mark(
        _timed("layer", qwen_moe.QwenMoeDecoderLayer.forward))
    attn = qwen_moe.QwenMoeAttention
    attn.forward = _timed("attention (incl. K/V gather)", attn.forward)
    communicator.gather_kv = _timed("  K/V gather", communicator.gather_kv)
    qwen_moe.prefill_attention = _timed("  attention kernels", qwen_moe.prefill_attention)
    lc = communicator.LayerCommunicator
    lc.prepare_mlp = _timed("prepare_mlp", lc.prepare_mlp)
    lc.postprocess_layer = _timed("postprocess_layer", lc.postprocess_layer)
    block = qwen_moe.QwenMoeSparseBlock
    block.routed = _timed("moe routed", block.routed)
    block.shared = _timed("moe shared", block.shared)
    for op in ("all_gather", "all_reduce", "all_to_all", "reduce_scatter"):
        setattr(comm, op, _timed(f"comm {op}", getattr(comm, op)))
    groups = ProcessGroups.build(layout, info.rank, info.device)
    runner = ModelRunner.from_config(config, groups, torch.bfloat16)
    seqs = [torch.randint(0, config["vocab_size"], (length,)).tolist()]
    if balanced:
        runner.record_expert_load()
        runner.prefill([torch.randint(0, config["vocab_size"], (length,)).tolist()],
                       last_only=True)
        report = runner.rebalance_experts()
        if info.rank == 0:
            print(f"busiest EP rank's load / mean: {report.busiest_before:.3f} -> "
                  f"{report.busiest_after:.3f}", flush=True)
    runner.prefill(seqs, last_only=True)
    torch.cuda.synchronize()
    comm.barrier(groups.world)
    SPANS.clear()
    HOST.clear()
    gc.callbacks.append(_gc_watch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    comm.all_reduce(torch.ones(1, device=info.device), groups.world)  # align the GPU clocks
    start.record()
    host0 = time.perf_counter()
    prof = cProfile.Profile() if cprofile else None
    if prof:
        prof.enable()
    runner.prefill(seqs, last_only=True)
    if prof:
        prof.disable()
        if info.rank == 0:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    gc.callbacks.remove(_gc_watch)
    end.record()
    torch.cuda.synchronize()
    out = {name: sum(s.elapsed_time(e) for s, e, _ in spans) for name, spans in SPANS.items()}
    out["total"] = start.elapsed_time(end)
    out["host: prefill entry to first layer"] = (HOST["first layer"] - host0) * 1e3
    out["host: in garbage collection"] = HOST.get("gc", 0.0) * 1e3
    layers = [s.elapsed_time(e) for s, e, _ in SPANS["layer"]]
    out["layer min"], out["layer max"] = min(layers), max(layers)
    out["last layer starts at"] = start.elapsed_time(SPANS["layer"][-1][0])
    out["first layer starts at"] = start.elapsed_time(SPANS["layer"][0][0])
    gaps = [e.elapsed_time(s2) for (_, e, _), (s2, _, _) in zip(SPANS["layer"], SPANS["layer"][1:])]
    out["gaps between layers"] = sum(gaps)
    if timeline is not None:
        spans = [(start.elapsed_time(s), start.elapsed_time(e), name)
                 for name, items in SPANS.items() for s, e, layer in items if layer == timeline]
        out["timeline"] = sorted(spans)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="tp=2,cp=2,dp=2", help="layouts separated by ';'")
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--threads", type=int, help="torch CPU threads per rank (default: launch's)")
    p.add_argument("--cprofile", action="store_true", help="host profile of rank 0's prefill")
    p.add_argument("--timeline", type=int, metavar="LAYER",
                   help="print this layer's phases as start/end ms on every rank")
    p.add_argument("--even-routing", action="store_true",
                   help="every expert gets the same slots (experiment; logits meaningless)")
    p.add_argument("--balanced", action="store_true",
                   help="place experts by a calibration prefill's load first")
    a = p.parse_args()
    config = dict(SHAPES["qwen3-30b-a3b"], num_hidden_layers=a.layers)
    for spec in a.layout.split(";"):
        layout = parse_layout(spec).layout
        with RankPool(layout.world_size, "cuda", collective_timeout_s=600) as pool:
            per_rank = pool.run(phase_task, config, layout, a.length, a.threads, a.cprofile,
                                a.timeline, a.even_routing, a.balanced)
        note = " even routing" * a.even_routing + " balanced placement" * a.balanced
        print(f"== {spec} length {a.length} layers {a.layers}{note} (ms, per rank)")
        timelines = [r.pop("timeline", None) for r in per_rank]
        for name in per_rank[0]:
            print(f"  {name:<32} " + "  ".join(f"{r.get(name, 0.0):9.1f}" for r in per_rank),
                  flush=True)
        for rank, spans in enumerate(timelines):
            if spans is None:
                continue
            print(f"  -- layer {a.timeline} on rank {rank} (start .. end ms, phase)")
            for s, e, name in spans:
                print(f"     {s:9.2f} .. {e:9.2f}  {e - s:8.2f}  {name.strip()}")


if __name__ == "__main__":
    main()
