"""`cpmoe bench-one-batch`: one static batch, prefill then decode steps (after SGLang's
`bench_one_batch`), cpmoe beside HF transformers on the same weights.

Per (engine, batch, input length) row: prefill seconds, the median decode step (as a stream
sees it: the interval between two steps' greedy tokens reaching the host; steps run as the
engine's overlap schedule runs them, or one after another with --disable-overlap-schedule),
decode tokens/s,
the HBM roofline of that step and the ratio, peak memory, and the routing the step saw
(distinct experts per layer, busiest expert / mean). The roofline counts the bytes one
step must read on the busiest rank: every non-expert weight (the LM head included; of the
embedding and of DeepSeek-V4's token -> expert hash tables only the batch's rows), each
layer's routed experts that the step really used (counted in an eager step of the same
batch), and the cache of every sequence (its shard on this rank: the K/V pages, or for
DeepSeek-V4 its own caches as `V4Cache.step_read_bytes` counts them: window rows, HCA
entries, CSA indexer keys and top-k entries), over the card's datasheet HBM bandwidth
(`hbm_bytes_per_s`: 4.8 TB/s on an H200, 3.35 on an H100 SXM; the H200's for a card not in
its table, and on CPU).

cpmoe runs in one spawned world per layout, HF afterwards in another (both at once do not
fit one GPU at 30B). HF runs eager with its dynamic cache and, for the batches asked, with a
static cache under `torch.compile(mode="reduce-overhead")` (its fastest set-up). With
`--routing uniform` both engines get the same redrawn routers and scaled residual writers
(moe/uniform_routing.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cpmoe.bench.model_task import prompts
from cpmoe.bench.timing import device_name, free_cached, median, peak_bytes, reset_peak, sync
from cpmoe.cp.kv_capacity import kv_slots_needed
from cpmoe.engine.engine import DeviceTokens
from cpmoe.engine.options import EngineOptions, prepare_runner
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.moe.experts import LocalExperts
from cpmoe.moe.placement import ExpertPlacement, layers_with_placement
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout

# datasheet HBM bandwidth by a name `torch.cuda.get_device_name` contains, first match
HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12),
                   ("H100", 3.35e12))


def hbm_bytes_per_s(name: str) -> float:
    """The roofline's bandwidth for a device named `name` (the H200's when not listed)."""
    return next((bw for key, bw in HBM_BYTES_PER_S if key in name), HBM_BYTES_PER_S[0][1])


@dataclass(frozen=True)
class OneBatchSpec:
    config: dict  # HF config.json contents
    model_dir: Path | None  # --model (with --load-format), else random weights of `config`
    layout: ParallelLayout
    dtype: torch.dtype
    seed: int
    routing: str  # "uniform" or "model"
    max_batch: int
    max_input: int
    output_len: int
    engine: EngineOptions
    profile_dir: Path | None = None  # --profile: one step's kernel table per row


_STATE: dict[str, object] = {}  # this rank process's runner / HF model between tasks


# ---- cpmoe -------------------------------------------------------------------------------------

def setup_task(info: RankInfo, spec: OneBatchSpec) -> dict | None:
    groups = ProcessGroups.build(spec.layout, info.rank, info.device)
    t0 = time.perf_counter()
    if spec.model_dir is not None:
        runner = ModelRunner(spec.model_dir, groups, spec.dtype, show_progress=False,
                             load_format=spec.engine.load_format, seed=spec.seed,
                             quantization=spec.engine.quantization)
    else:
        runner = ModelRunner.from_config(spec.config, groups, spec.dtype, seed=spec.seed,
                                         quantization=spec.engine.quantization)
    layout = spec.layout
    # + 3: the routing step and --profile's two steps decode past the timed ones
    need = kv_slots_needed([spec.max_input] * spec.max_batch, spec.output_len + 3,
                           layout.attn_cp_size, layout.cp_strategy, spec.engine.page_size)
    opts = EngineOptions(**{**spec.engine.__dict__, "max_total_tokens": need,
                            "cuda_graph_max_bs": spec.max_batch, "routing": spec.routing})
    sizes = prepare_runner(runner, opts, need)  # with --routing uniform: routers redrawn
    routers = None
    if spec.routing == "uniform":
        routers = {name: p.detach().cpu() for name, p in runner.model.named_parameters()
                   if name.endswith("mlp.gate.weight")}
    sync(info.device)
    _STATE["runner"] = runner
    mine = torch.tensor([float(runner.weight_bytes())], dtype=torch.float64, device=info.device)
    per_rank = runner.gather_from_ranks(mine)
    if info.rank != 0:
        return None
    return {"weight_bytes": [int(w[0]) for w in per_rank], "build_s": time.perf_counter() - t0,
            "device_name": device_name(info.device), "routers": routers, **sizes}


def row_task(info: RankInfo, spec: OneBatchSpec, batch: int, input_len: int) -> dict | None:
    runner: ModelRunner = _STATE["runner"]  # type: ignore[assignment]
    device, kv = info.device, runner.kv
    seqs = prompts(runner.config.vocab_size, input_len, batch, spec.seed)
    keys = list(range(batch))
    free_cached(device)
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    firsts = [runner.extend([Segment(k, seqs[k]) for k in group]).argmax(-1)
              for group in _groups(keys, input_len, spec.engine.chunked_prefill_size)]
    first = torch.cat(firsts)
    tokens = _broadcast_tokens(runner, first)
    prefill_s = time.perf_counter() - t0
    decode = _decode_synced if spec.engine.disable_overlap_schedule else _decode_overlapped
    with cuda_profiler_range(device):
        generated, steps = decode(runner, keys, first, tokens, spec.output_len - 1)
    tokens = generated[-1]
    peak = peak_bytes(device)
    if spec.profile_dir is not None:
        _profile_steps(runner, keys, tokens, spec.profile_dir / f"b{batch}-in{input_len}",
                       info.rank)
    context = [kv.local_len(k) for k in keys]
    routing = _routing_step(runner, keys, tokens)
    for k in keys:
        kv.free(k)
    mine = torch.tensor([_step_bytes(runner, routing["distinct_local"], context), float(peak)],
                        dtype=torch.float64, device=device)
    per_rank = runner.gather_from_ranks(mine)
    if info.rank != 0:
        return None
    step_s = median(steps) if steps else float("nan")
    bandwidth = hbm_bytes_per_s(device_name(device))
    roof_s = max(float(r[0]) for r in per_rank) / bandwidth
    return {"prefill_s": prefill_s, "decode_ms": step_s * 1e3, "decode_ms_steps": steps,
            "decode_tok_s": batch / step_s, "roofline_ms": roof_s * 1e3,
            "vs_roofline": step_s / roof_s, "step_bytes_busiest_rank": roof_s * bandwidth,
            "hbm_bytes_per_s": bandwidth,
            "peak_bytes_per_rank": [int(r[1]) for r in per_rank],
            "distinct_experts_per_layer": routing["distinct"],
            "busiest_expert_vs_mean": routing["busiest"],
            "tokens": [list(t) for t in zip(*generated)],
            "cuda_graphs": runner.graphs is not None and runner.graphs.fits(batch)}


def cuda_profiler_range(device: torch.device) -> contextlib.AbstractContextManager:
    """The CUDA profiler's capture range around the timed decode steps (torch's
    cudaProfilerStart / Stop context, no-ops when no profiler is attached): `ncu
    --profile-from-start off` and `nsys --capture-range=cudaProfilerApi` then see these steps
    only, not the warm-up, the graph capture or the prefill (`bash bench/h200_engine.sh
    decode-ncu`)."""
    return torch.cuda.profiler.profile() if device.type == "cuda" else contextlib.nullcontext()


def _decode_synced(runner: ModelRunner, keys: list[int], first: torch.Tensor,
                   tokens: list[int], steps: int) -> tuple[list[list[int]], list[float]]:
    """Decode steps that each bring their tokens to the host before the next starts
    (--disable-overlap-schedule) -> tokens per step (the first included), step seconds."""
    generated, times = [tokens], []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = _broadcast_tokens(runner, runner.decode(keys, tokens).argmax(-1))
        times.append(time.perf_counter() - t0)
        generated.append(tokens)
    return generated, times


def _decode_overlapped(runner: ModelRunner, keys: list[int], first: torch.Tensor,
                       tokens: list[int], steps: int) -> tuple[list[list[int]], list[float]]:
    """Decode as the engine's overlap schedule runs it: each step feeds on the previous
    step's tokens on the device, and the host waits for a step's tokens only after it has
    launched the next. A step's time is the interval between two steps' tokens reaching
    the host (what a stream sees)."""
    feed = [-(i + 1) for i in range(len(keys))]  # row i of the last shared tokens
    runner.share_tokens(first if runner.groups.rank == 0 else None, len(keys))
    generated, times = [tokens], []
    landed, in_flight = time.perf_counter(), None
    for _ in range(steps):
        mine = runner.decode(keys, feed).argmax(-1)
        sampled = DeviceTokens(runner.share_tokens(mine if runner.groups.rank == 0 else None,
                                                   len(keys)))
        if in_flight is not None:
            generated.append(in_flight.tolist())
            times.append(time.perf_counter() - landed)
            landed += times[-1]
        in_flight = sampled
    generated.append(in_flight.tolist())
    times.append(time.perf_counter() - landed)
    return generated, times


def _profile_steps(runner: ModelRunner, keys: list[int], tokens: list[int], stem: Path,
                   rank: int) -> None:
    """One decode step as run (graph replay where captured) and one eager, under
    torch.profiler: the kernels sorted by device time -> `{stem}-{mode}.txt` (rank 0)."""
    from torch.profiler import ProfilerActivity, profile
    graphs = runner.graphs
    for mode in ("replay", "eager") if graphs is not None else ("eager",):
        runner.graphs = graphs if mode == "replay" else None
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                tokens = _broadcast_tokens(runner, runner.decode(keys, tokens).argmax(-1))
                sync(runner.device)
        finally:
            runner.graphs = graphs
        if rank == 0:
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40,
                                              max_name_column_width=90)
            Path(f"{stem}-{mode}.txt").write_text(table + "\n")


def _groups(keys: list[int], length: int, chunk: int) -> list[list[int]]:
    """Prompts prefilled together: as many whole prompts as one chunk's tokens take."""
    per = max(1, chunk // length) if chunk > 0 else len(keys)
    return [keys[i:i + per] for i in range(0, len(keys), per)]


def _broadcast_tokens(runner: ModelRunner, tokens: torch.Tensor) -> list[int]:
    if runner.groups.world.size == 1:
        return tokens.tolist()
    return runner.broadcast_tokens(tokens.tolist())


def _routing_step(runner: ModelRunner, keys: list[int], tokens: list[int]) -> dict:
    """One eager decode step of the batch with expert load recorded (graphs do not record):
    distinct experts per layer (all, and held by this rank) and the busiest one's load."""
    graphs, runner.graphs = runner.graphs, None
    runner.record_expert_load()
    try:
        runner.decode(keys, tokens)
    finally:
        runner.graphs = graphs
    distinct, local, busiest = [], [], []
    for block in layers_with_placement(runner.model):
        placement: ExpertPlacement = block.placement
        load = placement.load.double()
        placement.load = None
        e_loc, first = block.experts.num_local_experts, block.dispatcher.first_expert
        physical = load[placement.physical_to_logical]  # slots per physical slot
        distinct.append(int((load > 0).sum()))
        local.append(int((physical[first:first + e_loc] > 0).sum()))
        busiest.append(float(load.max() / load.mean()) if load.sum() > 0 else 0.0)
    return {"distinct": distinct, "distinct_local": local, "busiest": busiest}


def _step_bytes(runner: ModelRunner, distinct_local: list[int], context: list[int]) -> float:
    """Bytes one decode step must read on this rank (see the module docstring)."""
    model = runner.model
    expert_bytes, per_expert = 0, []
    for m in model.modules():
        if isinstance(m, LocalExperts):
            size = sum(p.numel() * p.element_size() for p in m.parameters())
            expert_bytes += size
            per_expert.append(size / m.num_local_experts)
    embed = model.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size() if model.lm_head is not None else 0
    rows = len(context) * embed.shape[1] * embed.element_size()
    for name, p in model.named_parameters():  # hash routing reads one table row per token
        if name.endswith("tid2eid"):
            embed_bytes += p.numel() * p.element_size()
            rows += len(context) * p.shape[1] * p.element_size()
    dense = runner.weight_bytes() - expert_bytes - embed_bytes + rows
    experts = sum(n * b for n, b in zip(distinct_local, per_expert))
    if runner.own_cache:  # DeepSeek-V4: its own caches
        kv = runner.kv.step_read_bytes(context)
    else:
        kv = runner.kv.bytes_per_token() * (sum(context) + len(context))  # the pools' dtype
    return float(dense + experts + kv)


# ---- HF transformers ---------------------------------------------------------------------------

def hf_setup_task(info: RankInfo, spec: OneBatchSpec, routers: dict | None) -> dict:
    from cpmoe.bench.hf_task import build_hf_model, fill_like_cpmoe
    model, notes = build_hf_model(spec.config, spec.dtype, info.device)
    fill_like_cpmoe(model, spec.config, spec.seed, info.device, spec.dtype)
    if routers is not None:
        from cpmoe.moe.uniform_routing import RESIDUAL_SCALE, residual_scaled
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                if residual_scaled(name):
                    p.mul_(RESIDUAL_SCALE)
            for name, w in routers.items():
                params[name].copy_(w)
    _STATE["hf"] = model
    import transformers
    return {"transformers": transformers.__version__, "notes": notes,
            "device_name": device_name(info.device)}


def hf_row_task(info: RankInfo, spec: OneBatchSpec, batch: int, input_len: int,
                compiled: bool) -> dict:
    model = _STATE["hf"]
    device = info.device
    ids = torch.tensor(prompts(spec.config["vocab_size"], input_len, batch, spec.seed),
                       device=device)
    free_cached(device)
    reset_peak(device)
    with torch.inference_mode():
        if compiled:
            return _hf_static_compiled(model, ids, spec.output_len, device)
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        generated, steps, past = [tok.tolist()], [], out.past_key_values
        prefill_s = time.perf_counter() - t0
        for _ in range(spec.output_len - 1):
            t0 = time.perf_counter()
            out = model(input_ids=tok[:, None], past_key_values=past, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            generated.append(tok.tolist())
            steps.append(time.perf_counter() - t0)
            past = out.past_key_values
    return _hf_row(batch, prefill_s, steps, generated, device)


def _hf_static_compiled(model, ids: torch.Tensor, output_len: int, device) -> dict:
    from transformers import StaticCache
    torch._dynamo.reset()
    batch, length = ids.shape
    warm = 3  # compile and record the CUDA graphs first; those steps are not timed
    cache = StaticCache(config=model.config, max_cache_len=length + output_len + warm)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                cache_position=torch.arange(length, device=device))
    tok = out.logits[:, -1].argmax(-1)
    generated, steps = [tok.tolist()], []
    prefill_s = time.perf_counter() - t0
    for i in range(warm + output_len - 1):
        t0 = time.perf_counter()
        out = forward(input_ids=tok[:, None].clone(), past_key_values=cache, use_cache=True,
                      cache_position=torch.tensor([length + i], device=device))
        tok = out.logits[:, -1].argmax(-1)
        generated.append(tok.tolist())
        if i >= warm:
            steps.append(time.perf_counter() - t0)
    return {**_hf_row(batch, prefill_s, steps, generated[:1] + generated[warm + 1:], device),
            "note": f"the first {warm} decode steps compile and are not timed; tokens after "
                    f"them follow a longer context than eager's"}


def _hf_row(batch: int, prefill_s: float, steps: list[float], generated: list[list[int]],
            device) -> dict:
    step_s = median(steps) if steps else float("nan")
    return {"prefill_s": prefill_s, "decode_ms": step_s * 1e3, "decode_ms_steps": steps,
            "decode_tok_s": batch / step_s, "peak_bytes_per_rank": [peak_bytes(device)],
            "tokens": [list(t) for t in zip(*generated)]}
