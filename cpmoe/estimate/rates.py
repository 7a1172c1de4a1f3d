"""The measured rates a layout estimate is built from, the H200 defaults and the calibration
file.

Units are SI throughout: FLOP/s, bytes/s, seconds, bytes. Every rate is one GPU's (or one
link's between two GPUs), measured by cpmoe on the lent machines; `H200` names where each
default comes from. A calibration file (`cpmoe bench-calibrate --out FILE`) holds the same
fields measured on the user's GPU:

    {"format": "cpmoe-rates/1", "rates": {field: value, ...}, "sources": {field: text}}

Rates that depend on size are tables of (rows, rate) points, read linearly in log(rows)
between the points and flat beyond them: attention by a call's query rows, dense GEMMs by
their rows, the grouped expert GEMM by its slots per expert.

Invariants: every rate is finite and > 0 (times may be 0); a table's points are sorted by
rows with distinct rows; a file with a missing, unknown or bad field is refused with one line
naming the file and the field (RatesError).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "cpmoe-rates/1"
TABLES = ("dense_gemm_flops", "grouped_gemm_flops", "attention_flops")


class RatesError(ValueError):
    """A calibration file that cannot be used; the message is one line."""


@dataclass(frozen=True)
class Link:
    """A collective on the GPUs' link: time = latency_s + bytes on the wire / bus_bytes_per_s
    (nccl-tests' bus bandwidth, so the bytes are the ring's (n - 1) shares; cost.py)."""

    bus_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Rates:
    device: str
    gpu_memory_bytes: float
    dense_gemm_flops: tuple[tuple[int, float], ...]  # (rows, bf16 projection FLOP/s)
    grouped_gemm_flops: tuple[tuple[int, float], ...]  # (slots per expert, gate/up + down)
    attention_flops: tuple[tuple[int, float], ...]  # (query rows per call, causal FLOP/s)
    prefill_token_s: float  # norms, RoPE, router top-k, copies: seconds per row per layer
    prefill_slot_s: float  # gather, SwiGLU, weighted sum: seconds per (row, expert) slot
    prefill_fixed_s: float  # host time before the first layer, per prefill
    prefill_host_token_s: float  # and per prompt token (CP metadata, embedding)
    hbm_bytes_per_s: float  # one streaming read kernel
    read_fixed_s: float  # what such a kernel pays whatever it reads
    decode_layer_fixed_s: float  # a decode layer's small kernels (norms, top-k, ...) in graphs
    all_gather: Link
    reduce_scatter: Link
    all_to_all: Link
    padded_a2a_efficiency: float  # alltoall_padded's bandwidth over NCCL all_to_all's
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.device, str):
            raise RatesError(f"device: expected a string naming the GPU, got {self.device!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("device", "sources"):
                continue
            if isinstance(value, Link):
                _positive(f"{f.name}.bus_bytes_per_s", value.bus_bytes_per_s, rate=True)
                _positive(f"{f.name}.latency_s", value.latency_s, rate=False)
            elif f.name in TABLES:
                rows = [r for r, _ in value]
                if not value or rows != sorted(set(rows)) or rows[0] < 1:
                    raise RatesError(f"{f.name}: expected (rows, FLOP/s) points with distinct "
                                     f"rows >= 1 in increasing order, got {list(value)}")
                for r, v in value:
                    _positive(f"{f.name} at {r} rows", v, rate=True)
            else:
                _positive(f.name, value, rate=not f.name.endswith("_s"))

    def attention_rate(self, rows: float) -> float:
        """Causal attention FLOP/s for a call of `rows` query rows."""
        return interpolate(self.attention_flops, rows)

    def dense_rate(self, rows: float) -> float:
        return interpolate(self.dense_gemm_flops, rows)

    def grouped_rate(self, slots_per_expert: float) -> float:
        return interpolate(self.grouped_gemm_flops, slots_per_expert)


def _positive(name: str, value: object, rate: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (rate and value == 0):
        raise RatesError(f"{name}: expected a finite number {'> 0' if rate else '>= 0'}, "
                         f"got {value!r}")


def interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return y0 + t * (y1 - y0)
    return points[-1][1]


# ---- the H200 defaults ---------------------------------------------------------------------
# Link figures: nccl-tests-style bus bandwidth of 2 H200s over NVLink (NV18) at 16 MiB and
# 512 MiB per rank (shared/notes/gpu-envelope.md, 2026-11-30), as latency + bytes / bandwidth
# through both points: all_gather 177 / 267 GB/s -> 271.4 GB/s + 33.0 us; reduce_scatter
# 177 / 265 -> 269.3 GB/s + 32.5 us; all_to_all 147 / 289 -> 298.3 GB/s + 57.9 us.
H200 = Rates(
    device="NVIDIA H200 (cpmoe measurements, 2026-11-30 .. 2026-12-03)",
    gpu_memory_bytes=139 * 2**30,
    dense_gemm_flops=((16384, 776e12),),
    grouped_gemm_flops=((1024, 644e12),),
    attention_flops=((16384, 650e12), (65536, 602e12), (131072, 571e12)),
    prefill_token_s=21.5e-9,
    prefill_slot_s=4.22e-9,
    prefill_fixed_s=3.0e-3,
    prefill_host_token_s=0.19e-6,
    hbm_bytes_per_s=4.41e12,
    read_fixed_s=6.1e-6,
    decode_layer_fixed_s=23.4e-6,
    all_gather=Link(271.4e9, 33.0e-6),
    reduce_scatter=Link(269.3e9, 32.5e-6),
    all_to_all=Link(298.3e9, 57.9e-6),
    padded_a2a_efficiency=0.66,
    sources={
        "gpu_memory_bytes": "the lent H200's 139 GiB (device notes)",
        "dense_gemm_flops": "bench/results/prefill-profile-bf16-d28a8e6.log: 16K rows, 12 "
                            "layers, cuBLAS q/k/v + o projections 9.56 ms for 7.42 PFLOP",
        "grouped_gemm_flops": "same profile: grouped_mm 23.0 ms for 14.8 PFLOP, 1024 slots "
                              "an expert (random weights: 8 experts take 79% of the slots)",
        "attention_flops": "same profile: cuDNN 3.385 ms a layer at 16K; "
                           "bench/results/attention_cp-20261130.json: one-GPU GQA SDPA "
                           "58.4 ms at 64K, 246.5 ms at 128K (2*H*D*L^2 FLOPs, causal)",
        "prefill_token_s": "same profile: the kernels that are not attention, GEMM or the "
                           "per-slot ones, 4.22 ms over 12 layers x 16K rows",
        "prefill_slot_s": "same profile: gather 3.32 + SwiGLU 1.62 + weighted row sum 1.70 "
                          "ms over 12 layers x 16K rows x top-8",
        "prefill_fixed_s": "bench/results/profile-20261130.log: host time from prefill "
                           "entry to the first layer, 14-17 ms at 64K and 24-32 ms at 128K "
                           "(2 GPUs), through both points",
        "prefill_host_token_s": "same fit as prefill_fixed_s",
        "hbm_bytes_per_s": "BENCHMARKS.md read floor (read-floor-stream-5231e25.log): "
                           "grid-stride read, 6.1 us + 4.41 TB/s",
        "read_fixed_s": "same fit",
        "decode_layer_fixed_s": "decode-profile-bf16-nopdl-d922af2: router, top-k, "
                                "alignment, norms, RoPE, stage 2, slot sum at batch 64, "
                                "23.4 us a layer",
        "all_gather": "shared/notes/gpu-envelope.md NCCL 2 GPUs, 16 / 512 MiB per rank",
        "reduce_scatter": "same",
        "all_to_all": "same",
        "padded_a2a_efficiency": "bench/results/dispatch-device-time-20261130.json: "
                                 "alltoall_padded / NCCL all_to_all device time 0.66-0.75",
    },
)


# ---- the calibration file ------------------------------------------------------------------

def to_json(rates: Rates) -> dict:
    body = {}
    for f in dataclasses.fields(rates):
        value = getattr(rates, f.name)
        if f.name == "sources":
            continue
        if isinstance(value, Link):
            value = {"bus_bytes_per_s": value.bus_bytes_per_s, "latency_s": value.latency_s}
        elif f.name in TABLES:
            value = [[r, v] for r, v in value]
        body[f.name] = value
    return {"format": FORMAT, "rates": body, "sources": dict(rates.sources)}


def save(rates: Rates, path: Path) -> None:
    Path(path).write_text(json.dumps(to_json(rates), indent=1) + "\n")


def load(path: Path) -> Rates:
    """A calibration file -> Rates; RatesError (one line naming the file) when unusable."""
    where = f"--calibration {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise RatesError(f"{where}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise RatesError(f"{where}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RatesError(f"{where}: expected a JSON object with \"format\": \"{FORMAT}\" "
                         f"(written by cpmoe bench-calibrate)")
    body, sources = data.get("rates"), data.get("sources", {})
    if not isinstance(body, dict) or not isinstance(sources, dict):
        raise RatesError(f"{where}: \"rates\" and \"sources\" must be JSON objects")
    names = [f.name for f in dataclasses.fields(Rates) if f.name != "sources"]
    missing = [n for n in names if n not in body]
    unknown = sorted(set(body) - set(names))
    if missing or unknown:
        raise RatesError(f"{where}: fields missing {missing}, unknown {unknown}")
    kwargs: dict[str, object] = {}
    try:
        for name in names:
            value = body[name]
            if name in ("all_gather", "reduce_scatter", "all_to_all"):
                value = Link(float(value["bus_bytes_per_s"]), float(value["latency_s"]))
            elif name in TABLES:
                value = tuple((int(r), float(v)) for r, v in value)
            kwargs[name] = value
        return Rates(**kwargs, sources={str(k): str(v) for k, v in sources.items()})
    except RatesError as e:
        raise RatesError(f"{where}: {e}") from None
    except (TypeError, KeyError, ValueError) as e:
        raise RatesError(f"{where}: field {name!r} is malformed ({e})") from None
