"""`cpmoe bench-calibrate --out FILE [--shape NAME]`: the rates of `cpmoe plan --estimate`
measured on this machine's first CUDA GPU, in a few minutes, written as a calibration file.

Measured at the model shape's sizes (bf16, every figure the median of a few timed calls
with the host queued ahead, as a prefill runs: `bench.timing.device_timed`):
    dense_gemm_flops     the q/k/v and o projections of 4K, 16K and 64K rows
    grouped_gemm_flops   gate/up + down over all experts, 4K, 16K and 64K tokens x top-k,
                         balanced (their slots per expert are the table's rows)
    attention_flops      causal cuDNN SDPA (GQA heads) at 16K, 64K and 128K query rows
    prefill_token_s      two fused residual-add RMSNorms and the router's softmax top-k a row
    prefill_slot_s       gather, SwiGLU and the weighted row sum a (row, expert) slot
    hbm_bytes_per_s, read_fixed_s   a streaming read (torch.sum) of 400 MB and 1600 MB in
                         CUDA graphs, through both points
    gpu_memory_bytes     the device's total memory
Kept from the H200 defaults, with the reason in the file's sources: the link figures (one GPU
has no link to measure), alltoall_padded's efficiency, the host time before the first layer
and a decode layer's small kernels (both need the whole engine). Without CUDA the command
refuses with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from cpmoe.estimate.cost import ModelShape
from cpmoe.estimate.rates import H200, Rates, save

ATTENTION_ROWS = (16384, 65536, 131072)
GEMM_ROWS = (4096, 16384, 65536)
PREFILL_ROWS = 16384  # rows of the per-row / per-slot kernels


class CalibrationError(ValueError):
    """The calibration cannot run here; one line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpmoe.bench.spec import SHAPES
    p.add_argument("--out", type=Path, required=True, help="calibration file to write")
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-30b-a3b",
                   help="model sizes the GEMMs and attention are measured at")
    p.add_argument("--reps", type=int, default=5, help="timed calls per figure (median)")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise CalibrationError("bench-calibrate measures a CUDA GPU and none is visible "
                               "(torch.cuda.is_available() is False); cpmoe plan --estimate "
                               "runs without one on the shipped H200 rates")
    if args.reps < 1:
        raise CalibrationError(f"--reps must be >= 1, got {args.reps}")
    from cpmoe.bench.spec import parse_config, read_shape
    name, raw = read_shape(args.shape, None)
    m = ModelShape.from_config(parse_config(raw, f"--shape {name}"))
    rates = measure(m, torch.device("cuda", 0), args.reps)
    save(rates, args.out)
    print(f"wrote {args.out}: {rates.device}")
    return 0


def _median_s(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    from cpmoe.bench.timing import device_timed
    fn()  # warm-up: kernels chosen and compiled
    return statistics.median(device_timed(fn, device)[1] for _ in range(reps))


def _graph_s(fn: Callable[[], object], calls: int = 24) -> float:
    """Per call, from a CUDA graph of `calls` calls (no launch gaps between them); warmed up
    on a side stream first, as capture wants."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / calls


def measure(m: ModelShape, device: torch.device, reps: int) -> Rates:
    torch.manual_seed(0)
    D = m.head_dim
    dense = tuple((n, _dense_rate(m, n, device, reps)) for n in GEMM_ROWS)
    grouped = tuple((n * m.topk // m.experts, _grouped_rate(m, n, device, reps))
                    for n in GEMM_ROWS)
    attention = tuple((n, _attention_rate(m, n, device, reps)) for n in ATTENTION_ROWS)
    token_s, slot_s = _elementwise(m, device, reps)
    fixed, bw = _read_fit(device)
    kept = "kept from the H200 defaults: "
    sources = {
        "gpu_memory_bytes": "torch.cuda.get_device_properties(0).total_memory",
        "dense_gemm_flops": f"x @ W for q/k/v and o at {GEMM_ROWS} rows",
        "grouped_gemm_flops": f"grouped_mm gate/up + down, {GEMM_ROWS} tokens x top-{m.topk}, "
                              f"balanced over {m.experts} experts",
        "attention_flops": f"cuDNN causal SDPA, {m.q_heads}/{m.kv_heads} heads, d={D}",
        "prefill_token_s": "2 x ops.add_rms_norm + ops.softmax_topk a row",
        "prefill_slot_s": "gather + ops.silu_and_mul + ops.weighted_row_sum a slot",
        "hbm_bytes_per_s": "torch.sum over 400 MB and 1600 MB in CUDA graphs",
        "read_fixed_s": "same fit",
        **{k: kept + "needs the whole engine" for k in
           ("prefill_fixed_s", "prefill_host_token_s", "decode_layer_fixed_s")},
        **{k: kept + "one GPU has no link " + H200.sources.get(k, "") for k in
           ("all_gather", "reduce_scatter", "all_to_all", "padded_a2a_efficiency")},
    }
    props = torch.cuda.get_device_properties(device)
    return dataclasses.replace(
        H200, device=f"{props.name} (cpmoe bench-calibrate, torch {torch.__version__})",
        gpu_memory_bytes=float(props.total_memory), dense_gemm_flops=dense,
        grouped_gemm_flops=grouped, attention_flops=attention, prefill_token_s=token_s,
        prefill_slot_s=slot_s, hbm_bytes_per_s=bw, read_fixed_s=fixed, sources=sources)


def _dense_rate(m: ModelShape, rows: int, device: torch.device, reps: int) -> float:
    bf = dict(device=device, dtype=torch.bfloat16)
    H, D = m.hidden, m.head_dim
    x = torch.randn(rows, H, **bf)
    w_qkv = torch.randn((m.q_heads + 2 * m.kv_heads) * D, H, **bf) / H**0.5
    w_o = torch.randn(H, m.q_heads * D, **bf) / H**0.5
    attn_out = torch.randn(rows, m.q_heads * D, **bf)
    seconds = _median_s(lambda: (x @ w_qkv.t(), attn_out @ w_o.t()), device, reps)
    return 2.0 * rows * H * (w_qkv.shape[0] + w_o.shape[1]) / seconds


def _grouped_rate(m: ModelShape, tokens: int, device: torch.device, reps: int) -> float:
    import torch.nn.functional as F
    grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm")
    bf = dict(device=device, dtype=torch.bfloat16)
    E, H, inter = m.experts, m.hidden, m.moe_inter
    slots = tokens * m.topk // E * E  # balanced: the same slots for every expert
    x = torch.randn(slots, H, **bf)
    gate_up = torch.randn(E, 2 * inter, H, **bf) / H**0.5
    down = torch.randn(E, H, inter, **bf) / inter**0.5
    act = torch.randn(slots, inter, **bf)  # SwiGLU's output: its time is prefill_slot_s's
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (slots // E)

    def experts() -> tuple[torch.Tensor, torch.Tensor]:
        return (grouped_mm(x, gate_up.transpose(1, 2), offs=offs),
                grouped_mm(act, down.transpose(1, 2), offs=offs))
    return 2.0 * slots * 3 * H * inter / _median_s(experts, device, reps)


def _attention_rate(m: ModelShape, rows: int, device: torch.device, reps: int) -> float:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    bf = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(1, m.q_heads, rows, m.head_dim, **bf)
    k = torch.randn(1, m.kv_heads, rows, m.head_dim, **bf)
    v = torch.randn_like(k)

    def attend() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return 2.0 * m.q_heads * m.head_dim * rows * rows / _median_s(attend, device, reps)


def _elementwise(m: ModelShape, device: torch.device, reps: int) -> tuple[float, float]:
    from cpmoe.ops.activation import silu_and_mul, weighted_row_sum
    from cpmoe.ops.norm import add_rms_norm
    from cpmoe.ops.routing import softmax_topk
    bf = dict(device=device, dtype=torch.bfloat16)
    T, H, k = PREFILL_ROWS, m.hidden, m.topk
    x, res, w = torch.randn(T, H, **bf), torch.randn(T, H, **bf), torch.ones(H, **bf)
    logits = torch.randn(T, m.experts, device=device, dtype=torch.float32)

    def per_row() -> object:
        add_rms_norm(x, res, w, 1e-6)
        add_rms_norm(x, res, w, 1e-6)
        return softmax_topk(logits, k, True, torch.bfloat16)
    rows = torch.randint(0, T, (T * k,), device=device)
    h = torch.randn(T * k, 2 * m.moe_inter, **bf)
    y = torch.randn(T * k, H, **bf)
    index = torch.arange(T * k, device=device).view(T, k)
    weight = torch.rand(T, k, **bf)

    def per_slot() -> object:
        x[rows]
        silu_and_mul(h)
        return weighted_row_sum(y, index, weight)
    return _median_s(per_row, device, reps) / T, _median_s(per_slot, device, reps) / (T * k)


def _read_fit(device: torch.device) -> tuple[float, float]:
    """(fixed seconds, bytes/s) of one streaming read, through 400 MB and 1600 MB; six
    rotated copies so no call finds its input in L2."""
    sizes = (400e6, 1600e6)
    times = [_read_s(int(size), device) for size in sizes]
    bw = (sizes[1] - sizes[0]) / max(times[1] - times[0], 1e-9)
    return max(0.0, times[0] - sizes[0] / bw), bw


def _read_s(nbytes: int, device: torch.device) -> float:
    copies = [torch.ones(nbytes // 4, device=device) for _ in range(6)]
    turn = iter(range(10**9))  # each captured call reads the next copy
    return _graph_s(lambda: copies[next(turn) % 6].sum())
