"""CP attention alone: cpmoe's CP path and PyTorch's ring `context_parallel`, each against
one-device SDPA measured in the same run (`python3 -m cpmoe.bench.attention_cp` is the script).

- cpmoe: the functions the model calls, `communicator.gather_kv` (one all-gather of the
  K/V chunks over ATTN_CP) and `cp.attention.prefill_attention`, on a zigzag `CPSplit`,
  GQA (q_heads / kv_heads), row `cpmoe_cp`, against causal SDPA with `enable_gqa`; and the
  same with MHA (kv_heads = q_heads), row `cpmoe_cp_mha`, against causal MHA SDPA: the
  shape PyTorch's ring takes, so only this row compares the two at equal K/V bytes.
- torch: `torch.distributed.tensor.experimental.context_parallel` (ring SDPA) with each
  rotate method, MHA with q_heads heads (as the envelope's peer baseline); its one-device
  reference is causal MHA SDPA.
Each CP result is checked against its one-device output (max |diff| over the sequence).
Every step is its own pool task, so a failure (PyTorch CP has no CPU kernels, for one)
becomes an error row and the rest still runs.

Legend: S = sequence length, H = q heads, Hkv = KV heads, D = head dim, T = local rows.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cpmoe import communicator
from cpmoe.bench import report as rp
from cpmoe.bench.pooled import Pooled
from cpmoe.bench.timing import device_name, keep_multicast_off, median, sync, timed
from cpmoe.cp.attention import prefill_attention, query_runs
from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.cp.split import CPSplit
from cpmoe.parallel import comm
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class AttnSpec:
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    warmup: int
    iters: int
    seed: int = 0

    @property
    def flops(self) -> float:
        """Causal attention: QK^T and PV over the visible half of S x S, every q head."""
        return 2.0 * self.seq_len**2 * self.q_heads * self.head_dim


def _qkv(spec: AttnSpec, kv_heads: int, device: torch.device) -> list[torch.Tensor]:
    """Full q [S, H, D], k, v [S, kv_heads, D], the same on every rank (seeded)."""
    gen = torch.Generator(device=device).manual_seed(spec.seed * 7919 + spec.seq_len)
    shapes = [(spec.seq_len, spec.q_heads, spec.head_dim)] + \
        [(spec.seq_len, kv_heads, spec.head_dim)] * 2
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(spec.dtype)
            for s in shapes]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[S, H, D] layout in and out; causal; GQA when k has fewer heads."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True,
                                       enable_gqa=k.shape[1] != q.shape[1])
    return o[0].transpose(0, 1)


def _time(step, spec: AttnSpec, device: torch.device, align=None) -> tuple[list[float], object]:
    """Warm-up then timed calls; `align` (a barrier) lines the ranks up before each."""
    for _ in range(spec.warmup):
        step()
    times, out = [], None
    for _ in range(spec.iters):
        if align is not None:
            align()
        out, seconds = timed(step, device)
        times.append(seconds)
    return times, out


def single_task(info: RankInfo, spec: AttnSpec) -> dict | None:
    """Rank 0 alone: one-device SDPA, GQA and MHA (the other ranks return at once)."""
    if info.rank != 0:
        return None
    return {"device_name": device_name(info.device),
            "sdpa_gqa": _time_sdpa(spec, spec.kv_heads, info.device),
            "sdpa_mha": _time_sdpa(spec, spec.q_heads, info.device)}


def _time_sdpa(spec: AttnSpec, kv_heads: int, device: torch.device) -> float:
    q, k, v = _qkv(spec, kv_heads, device)
    return median(_time(lambda: _sdpa(q, k, v), spec, device)[0])


def cpmoe_task(info: RankInfo, spec: AttnSpec, kv_heads: int | None = None) -> dict | None:
    """Every rank: its zigzag chunk of q against the gathered K/V, as the model does it;
    kv_heads (default spec.kv_heads) = q heads gives the ring's MHA shape, K/V bytes alike."""
    kv_heads = kv_heads or spec.kv_heads
    cp = info.world_size
    groups = ProcessGroups.build(ParallelLayout(tp_size=cp, attn_cp_size=cp), info.rank,
                                 info.device)
    split = CPSplit.build([spec.seq_len], cp, "zigzag")
    r = groups.attn_cp.rank
    q, k, v = (split.scatter(t, r) for t in _qkv(spec, kv_heads, info.device))
    positions, token_to_seq = split.local_positions(r), split.local_token_to_seq(r)
    batch = ForwardBatch(is_decode=False, input_ids=positions.to(info.device),
                         positions=positions.to(info.device),
                         token_to_seq=token_to_seq.to(info.device),
                         split=split, q_runs=query_runs(positions, token_to_seq))
    scale = spec.head_dim ** -0.5

    def step() -> torch.Tensor:
        k_flat, v_flat = communicator.gather_kv(k, v, batch, groups)
        return prefill_attention(q, batch.positions, batch.token_to_seq, k_flat, v_flat,
                                 list(split.cu_seqlens), scale, batch.q_runs)

    times, o = _time(step, spec, info.device, align=lambda: comm.barrier(groups.world))
    groups.start_timing()
    step()
    comm_s = sum(groups.stop_timing().values())
    full = _qkv(spec, kv_heads, info.device)
    want = split.scatter(_sdpa(*full), r)
    diff = (o.float() - want.float()).abs().max()
    del full, want
    mine = torch.tensor([median(times), comm_s, float(diff)], dtype=torch.float64,
                        device=info.device)
    per_rank = comm.all_gather(mine[None], groups.world).cpu()
    if info.rank != 0:
        return None
    return {"seconds": float(per_rank[:, 0].max()), "comm_s_per_rank": per_rank[:, 1].tolist(),
            "max_abs_diff": float(per_rank[:, 2].max())}


def _torch_cp_api():
    """(context_parallel, context_parallel_unshard, set_rotate_method) of this torch."""
    from torch.distributed.tensor.experimental import context_parallel
    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            context_parallel_unshard,
            set_rotate_method,
        )
    except ImportError:  # torch versions before the _context_parallel package
        from torch.distributed.tensor.experimental._attention import (
            context_parallel_unshard,
            set_rotate_method,
        )
    return context_parallel, context_parallel_unshard, set_rotate_method


def torch_cp_task(info: RankInfo, spec: AttnSpec, rotate: str) -> dict | None:
    """Every rank: PyTorch ring SDPA on its load-balanced shard, MHA [1, H, S, D]."""
    from torch.distributed.device_mesh import init_device_mesh
    context_parallel, unshard, set_rotate_method = _torch_cp_api()
    groups = ProcessGroups.build(ParallelLayout(tp_size=info.world_size), info.rank,
                                 info.device)
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    q, k, v = (t.transpose(0, 1)[None].contiguous()
               for t in _qkv(spec, spec.q_heads, info.device))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    set_rotate_method(rotate)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                          no_restore_buffers={q, k, v}):
        times, o = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         spec, info.device, align=lambda: comm.barrier(groups.world))
    got = unshard(mesh, [o], [2])[0]
    sync(info.device)
    diff = (got.float() - want.float()).abs().max()
    mine = torch.tensor([median(times), float(diff)], dtype=torch.float64, device=info.device)
    per_rank = comm.all_gather(mine[None], groups.world).cpu()
    if info.rank != 0:
        return None
    return {"seconds": float(per_rank[:, 0].max()), "max_abs_diff": float(per_rank[:, 1].max())}


# ---- the script ------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m cpmoe.bench.attention_cp",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--gpus", type=int, default=2, help="CP ranks (one GPU each)")
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--rotate", default="allgather,alltoall",
                   help="PyTorch CP rotate methods to run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (lengths 256,512; 4/2 heads of 16; float32 on cpu)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep_multicast_off()
    if args.smoke:
        lengths, heads, dim, iters = [256, 512], (4, 2), 16, min(args.iters, 2)
    else:
        lengths, heads, dim, iters = ([int(x) for x in args.lengths.split(",")], (32, 4), 128,
                                      args.iters)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    out = args.out or Path("bench/results") / (f"attention_cp-{args.device}"
                                               f"{'-smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    head = {**rp.provenance(None if argv is None else ["-m", "cpmoe.bench.attention_cp", *argv]),
            "what": "CP attention alone, causal, one sequence", "gpus": args.gpus,
            "q_heads": heads[0], "kv_heads": heads[1], "head_dim": dim, "dtype": str(dtype),
            "device": args.device, "warmup": args.warmup, "iters": iters, "gpu": None}
    with Pooled(args.gpus, args.device) as pooled:
        for S in lengths:
            spec = AttnSpec(S, heads[0], heads[1], dim, dtype, args.warmup, iters)
            rows.extend(_one_length(pooled, spec, args.rotate.split(","), head))
            rp.write_json(out, head, rows)
    print(_table(rows))
    for S in lengths:
        speedups = [f"{r['engine']} {r['speedup_vs_one_device']:.2f}x vs {r['baseline']}"
                    for r in rows if r["length"] == S and r.get("speedup_vs_one_device")]
        print(f"S={S} on {args.gpus} {'GPUs' if args.device == 'cuda' else 'ranks'}: " + (" | ".join(speedups) or "no result"))
    print(f"wrote {out}")
    return 1 if any(r.get("error") not in (None, "skipped") for r in rows) else 0


def _one_length(pooled: Pooled, spec: AttnSpec, rotates: list[str], head: dict) -> list[dict]:
    S, n = spec.seq_len, pooled.world_size
    rp.progress(f"attention S={S}: one-device SDPA (GQA {spec.q_heads}/{spec.kv_heads}, MHA)")
    single, failed = pooled.run(f"S={S} one-device SDPA", single_task, spec)
    if failed:
        return [{"engine": "sdpa", "length": S, "error": failed.error,
                 "error_detail": failed.detail}]
    head["gpu"] = head["gpu"] or single["device_name"]
    rows = [_row("sdpa_gqa", S, 1, single["sdpa_gqa"], spec, None),
            _row("sdpa_mha", S, 1, single["sdpa_mha"], spec, None)]
    # cpmoe on the model's GQA heads, and on MHA heads: the ring needs MHA, so only the
    # second compares equal K/V bytes
    runs = [("cpmoe_cp", "sdpa_gqa", cpmoe_task, ()),
            ("cpmoe_cp_mha", "sdpa_mha", cpmoe_task, (spec.q_heads,))] + \
        [(f"torch_cp_{r}", "sdpa_mha", torch_cp_task, (r,)) for r in rotates]
    for engine, base, task, extra in runs:
        if engine.startswith("torch_cp") and pooled.device == "cpu":
            rows.append({"engine": engine, "length": S, "ranks": n, "error": "skipped",
                         "error_detail": "PyTorch context_parallel has no CPU kernels"})
            continue
        rp.progress(f"attention S={S}: {engine} on {n} ranks")
        res, failed = pooled.run(f"S={S} {engine}", task, spec, *extra)
        if failed:
            rows.append({"engine": engine, "length": S, "ranks": n, "error": failed.error,
                         "error_detail": failed.detail})
            rp.progress(f"attention S={S}: {engine}: {failed.detail}")
            continue
        row = _row(engine, S, n, res["seconds"], spec, single[base])
        row.update(max_abs_diff_vs_one_device=res["max_abs_diff"], baseline=base,
                   comm_s_per_rank=res.get("comm_s_per_rank"))
        rows.append(row)
        rp.progress(f"attention S={S}: {engine}: {row['seconds'] * 1e3:.1f} ms, speed-up "
                    f"{row['speedup_vs_one_device']:.2f}x vs {base}, max |diff| "
                    f"{row['max_abs_diff_vs_one_device']:.2e}")
    return rows


def _row(engine: str, S: int, ranks: int, seconds: float, spec: AttnSpec,
         baseline_s: float | None) -> dict:
    return {"engine": engine, "length": S, "ranks": ranks, "seconds": seconds,
            "tflops_per_s_total": spec.flops / seconds / 1e12,
            "speedup_vs_one_device": baseline_s / seconds if baseline_s else None,
            "error": None}


def _table(rows: list[dict]) -> str:
    lines = [("| engine | S | ranks | ms | TFLOP/s (all ranks) | speed-up vs 1 device | "
              "max abs diff | error |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['seconds'] * 1e3:.1f}" if r.get("seconds") else "-"
        tf = f"{r['tflops_per_s_total']:.0f}" if r.get("seconds") else "-"
        sp = f"{r['speedup_vs_one_device']:.2f}x" if r.get("speedup_vs_one_device") else "-"
        df = (f"{r['max_abs_diff_vs_one_device']:.1e}"
              if r.get("max_abs_diff_vs_one_device") is not None else "-")
        err = f"{r['error']} ({r.get('error_detail', '')})" if r.get("error") else ""
        lines.append(f"| {r['engine']} | {r['length']} | {r.get('ranks', 1)} | {ms} | {tf} | "
                     f"{sp} | {df} | {err} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
