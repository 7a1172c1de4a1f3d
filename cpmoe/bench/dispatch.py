"""Dispatch + combine effective bandwidth of every rank-local cpmoe dispatch backend, against
NCCL `all_to_all_single` bus bandwidth for the same bytes measured in the same run
(`python3 -m cpmoe.bench.dispatch` is the script).

Routing is Qwen3-30B-A3B-like: hidden 2048 bf16, 128 experts, top-8 distinct random experts
per token, N tokens per rank. Bytes counted are the useful ones: every token's hidden row to
each *other* EP rank owning one of its experts (dispatch), and the same rows back (combine);
ids and weights are not counted. effective GB/s = those bytes / (dispatch + combine time),
per rank, and the slowest rank is reported. The NCCL reference moves the same number of
remote bytes per rank in one `all_to_all_single` with an even split; its bus bandwidth is
algbw * (n-1)/n (nccl-tests' definition), which is the same "remote bytes / time".
Both sides are timed two ways: host-timed (device drained before and after: includes every
kernel's launch latency) and device time with the host queued ahead (`device_timed`: the
prefill regime, where the host runs ahead of the GPU, and nccl-tests' back-to-back method).
The experts are a pass-through (combine gets the received rows back), so only movement and
the backends' own bookkeeping are timed.

Legend: N = tokens per rank, H = hidden, E = experts, K = top-k, M = received rows.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from cpmoe.bench import report as rp
from cpmoe.bench.pooled import Pooled
from cpmoe.bench.timing import device_name, device_timed, keep_multicast_off, median, timed
from cpmoe.moe.dispatch import MissingBackendError, create_dispatcher
from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import RANK_LOCAL_BACKENDS, ParallelLayout


@dataclass(frozen=True)
class DispatchSpec:
    tokens: int  # per rank
    hidden: int
    experts: int
    top_k: int
    dtype: torch.dtype
    warmup: int
    iters: int
    seed: int = 0


def routing(spec: DispatchSpec, rank: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's x_NH, topk_ids_NK (K distinct uniform experts per token), weights_NK."""
    gen = torch.Generator(device=device).manual_seed(spec.seed * 7919 + rank * 131 + spec.tokens)
    x = torch.randn(spec.tokens, spec.hidden, generator=gen, device=device).to(spec.dtype)
    scores = torch.rand(spec.tokens, spec.experts, generator=gen, device=device)
    weights, ids = scores.topk(spec.top_k, dim=-1)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).to(spec.dtype)


def remote_bytes(ids_NK: torch.Tensor, ep_rank: int, ep_size: int, experts: int,
                 row_bytes: int) -> int:
    """Hidden-row bytes this rank must send to other EP ranks: one row per (token, other
    rank owning at least one of the token's experts)."""
    dest_NK = ids_NK // (experts // ep_size)
    ranks = torch.arange(ep_size, device=ids_NK.device)
    needs_RN = (dest_NK[None] == ranks[:, None, None]).any(dim=-1)
    needs_RN[ep_rank] = False
    return int(needs_RN.sum()) * row_bytes


def _experts_stand_in(recv_x_MH: torch.Tensor, recv_ids_MK: torch.Tensor,
                      recv_w_MK: torch.Tensor) -> torch.Tensor:
    """Identity experts: each row times the routing weight of its local slots. Combine then
    returns x times the token's whole weight mass, i.e. x (weights sum to 1): a check."""
    mass = torch.where(recv_ids_MK >= 0, recv_w_MK.float(), 0.0).sum(-1, keepdim=True)
    return (recv_x_MH.float() * mass).to(recv_x_MH.dtype)


def backend_task(info: RankInfo, spec: DispatchSpec, backend: str) -> dict | None:
    n = info.world_size
    groups = ProcessGroups.build(ParallelLayout(tp_size=n, ep_size=n, moe_a2a_backend=backend),
                                 info.rank, info.device)
    dispatcher = create_dispatcher(backend, groups, spec.experts)
    x, ids, w = routing(spec, info.rank, info.device)
    row_bytes = spec.hidden * x.element_size()
    sent = remote_bytes(ids, groups.moe_ep.rank, n, spec.experts, row_bytes)
    out = {}

    def align() -> None:
        comm.barrier(groups.world)

    def round_trip(clock) -> tuple[float, float, bool, torch.Tensor]:
        """Dispatch, stand-in experts, combine; -> (dispatch s, combine s, queued, x back),
        each side timed by clock(fn) -> (fn(), seconds, host queued ahead)."""
        align()
        (recv_x, recv_ids, recv_w, handle), t_d, q_d = clock(
            lambda: dispatcher.dispatch(x, ids, w))
        y = _experts_stand_in(recv_x, recv_ids, recv_w)
        align()
        back, t_c, q_c = clock(lambda: dispatcher.combine(y, handle))
        return t_d, t_c, q_d and q_c, back

    for _ in range(spec.warmup):
        round_trip(lambda fn: (fn(), 0.0, True))
    host, device = [], []
    for _ in range(spec.iters):
        host.append(round_trip(lambda fn: (*timed(fn, info.device), True)))
        device.append(round_trip(lambda fn: device_timed(fn, info.device)))
    back = device[-1][3]
    out["max_abs_diff"] = float((back.float() - x.float()).abs().max())
    mine = torch.tensor([median([r[0] for r in host]), median([r[1] for r in host]),
                         float(sent), out["max_abs_diff"], median([r[0] for r in device]),
                         median([r[1] for r in device]), float(all(r[2] for r in device))],
                        dtype=torch.float64, device=info.device)
    per_rank = comm.all_gather(mine[None], groups.world).cpu()
    if info.rank != 0:
        return None
    return {"dispatch_s_per_rank": per_rank[:, 0].tolist(),
            "combine_s_per_rank": per_rank[:, 1].tolist(),
            "remote_bytes_per_rank": [int(b) for b in per_rank[:, 2]],
            "max_abs_diff": float(per_rank[:, 3].max()),
            "dispatch_device_s_per_rank": per_rank[:, 4].tolist(),
            "combine_device_s_per_rank": per_rank[:, 5].tolist(),
            "host_queued_ahead": bool(per_rank[:, 6].min() > 0),
            "device_name": device_name(info.device)}


def nccl_task(info: RankInfo, spec: DispatchSpec, remote_bytes_per_rank: int) -> dict | None:
    """all_to_all_single with an even split moving remote_bytes_per_rank to the other ranks."""
    n = info.world_size
    groups = ProcessGroups.build(ParallelLayout(tp_size=n), info.rank, info.device)
    row_bytes = spec.hidden * torch.empty((), dtype=spec.dtype).element_size()
    per_peer = max(1, remote_bytes_per_rank // (row_bytes * (n - 1)))  # rows to each rank
    send = torch.ones(n * per_peer, spec.hidden, dtype=spec.dtype, device=info.device)

    def step() -> torch.Tensor:
        return comm.all_to_all(send, [per_peer] * n, [per_peer] * n, groups.world)

    for _ in range(spec.warmup):
        step()
    times, device_times, queued = [], [], True
    for _ in range(spec.iters):
        comm.barrier(groups.world)
        times.append(timed(step, info.device)[1])
        comm.barrier(groups.world)
        _, s, q = device_timed(step, info.device)
        device_times.append(s)
        queued = queued and q
    mine = torch.tensor([median(times), median(device_times), float(queued)],
                        dtype=torch.float64, device=info.device)
    per_rank = comm.all_gather(mine[None], groups.world).cpu()
    if info.rank != 0:
        return None
    seconds, device_seconds = float(per_rank[:, 0].max()), float(per_rank[:, 1].max())
    moved = per_peer * row_bytes * (n - 1)
    return {"seconds": seconds, "device_seconds": device_seconds,
            "remote_bytes_per_rank": moved, "busbw_gbps": moved / seconds / 1e9,
            "device_busbw_gbps": moved / device_seconds / 1e9,
            "host_queued_ahead": bool(per_rank[:, 2].min() > 0)}


# ---- the script ------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m cpmoe.bench.dispatch",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--gpus", type=int, default=2, help="EP ranks (one GPU each)")
    p.add_argument("--tokens", default="4096,8192,16384,32768,65536", help="tokens per rank")
    p.add_argument("--backends", default=",".join(RANK_LOCAL_BACKENDS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (hidden 64, 8 experts top-2, 64/256 tokens; float32 on cpu)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep_multicast_off()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.smoke:
        tokens, shape, iters = [64, 256], (64, 8, 2), min(args.iters, 2)
    else:
        tokens, shape, iters = [int(t) for t in args.tokens.split(",")], (2048, 128, 8), args.iters
    out = args.out or Path("bench/results") / (f"dispatch-{args.device}"
                                               f"{'-smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {**rp.provenance(None if argv is None else ["-m", "cpmoe.bench.dispatch", *argv]),
            "what": "dispatch+combine effective bandwidth vs NCCL all_to_all_single",
            "ranks": args.gpus, "hidden": shape[0], "experts": shape[1], "top_k": shape[2],
            "dtype": str(dtype), "device": args.device,
            "warmup": args.warmup, "iters": iters, "gpu": None,
            "bytes": "remote hidden-row bytes per rank (ids and weights not counted)"}
    rows: list[dict] = []
    with Pooled(args.gpus, args.device) as pooled:
        for n_tok in tokens:
            spec = DispatchSpec(n_tok, *shape, dtype, args.warmup, iters)
            for backend in args.backends.split(","):
                rows.append(_one(pooled, spec, backend, head))
                rp.write_json(out, head, rows)
    print(_table(rows))
    print(f"wrote {out}")
    return 1 if any(r.get("error") not in (None, "skipped") for r in rows) else 0


def _one(pooled: Pooled, spec: DispatchSpec, backend: str, head: dict) -> dict:
    base = {"backend": backend, "tokens_per_rank": spec.tokens, "ranks": pooled.world_size}
    try:  # a backend whose package is missing is a skipped row, not a failed world
        create_dispatcher(backend, ProcessGroups.single(), spec.experts)
    except MissingBackendError as e:
        return {**base, "error": "skipped", "error_detail": str(e)}
    rp.progress(f"dispatch {backend}: {spec.tokens} tokens/rank")
    res, failed = pooled.run(f"{backend} {spec.tokens}", backend_task, spec, backend)
    if failed:
        return {**base, "error": failed.error, "error_detail": failed.detail}
    head["gpu"] = head["gpu"] or res["device_name"]

    def effective(dispatch_key: str, combine_key: str) -> float:
        """dispatch + combine bytes over their time on the slowest rank."""
        seconds = [d + c for d, c in zip(res[dispatch_key], res[combine_key])]
        slowest = max(range(len(seconds)), key=lambda r: seconds[r])
        return 2 * res["remote_bytes_per_rank"][slowest] / seconds[slowest] / 1e9

    eff = effective("dispatch_s_per_rank", "combine_s_per_rank")
    eff_dev = effective("dispatch_device_s_per_rank", "combine_device_s_per_rank")
    nccl, failed = pooled.run(f"nccl {spec.tokens}", nccl_task, spec,
                              max(res["remote_bytes_per_rank"]))
    row = {**base, **{k: v for k, v in res.items() if k != "device_name"},
           "effective_gbps": eff, "nccl_busbw_gbps": nccl["busbw_gbps"] if nccl else None,
           "ratio_vs_nccl": eff / nccl["busbw_gbps"] if nccl else None,
           "effective_device_gbps": eff_dev,
           "nccl_device_busbw_gbps": nccl["device_busbw_gbps"] if nccl else None,
           "ratio_vs_nccl_device": eff_dev / nccl["device_busbw_gbps"] if nccl else None,
           "nccl_host_queued_ahead": nccl["host_queued_ahead"] if nccl else None,
           "error": None if nccl else failed.error,
           "error_detail": None if nccl else failed.detail}
    rp.progress(f"dispatch {backend}: {spec.tokens} tokens/rank: dispatch "
                f"{1e3 * max(res['dispatch_s_per_rank']):.2f} ms, combine "
                f"{1e3 * max(res['combine_s_per_rank']):.2f} ms, effective {eff:.1f} GB/s "
                f"host-timed, {eff_dev:.1f} GB/s device time"
                + (f"; NCCL a2a {row['nccl_busbw_gbps']:.1f} / "
                   f"{row['nccl_device_busbw_gbps']:.1f} GB/s" if nccl else ""))
    return row


def _table(rows: list[dict]) -> str:
    lines = [("| backend | tokens/rank | remote MiB/rank | host-timed: dispatch + combine ms | "
              "effective GB/s | NCCL a2a busbw GB/s | ratio | device time: dispatch + "
              "combine ms | effective GB/s | NCCL a2a busbw GB/s | ratio | max abs diff | "
              "error |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        if r.get("dispatch_s_per_rank"):
            host_ms = 1e3 * max(d + c for d, c in zip(r["dispatch_s_per_rank"],
                                                      r["combine_s_per_rank"]))
            dev_ms = 1e3 * max(d + c for d, c in zip(r["dispatch_device_s_per_rank"],
                                                     r["combine_device_s_per_rank"]))
            cells = [f"{max(r['remote_bytes_per_rank']) / 2**20:.1f}", f"{host_ms:.3f}",
                     f"{r['effective_gbps']:.1f}", f(r["nccl_busbw_gbps"], ".1f"),
                     f(r["ratio_vs_nccl"], ".2f"), f"{dev_ms:.3f}",
                     f"{r['effective_device_gbps']:.1f}", f(r["nccl_device_busbw_gbps"], ".1f"),
                     f(r["ratio_vs_nccl_device"], ".2f"), f"{r['max_abs_diff']:.1e}"]
        else:
            cells = ["-"] * 10
        err = f"{r['error']} ({r.get('error_detail')})" if r.get("error") else ""
        lines.append(f"| {r['backend']} | {r['tokens_per_rank']} | " + " | ".join(cells) +
                     f" | {err} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
