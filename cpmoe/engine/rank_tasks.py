"""What one rank does for each CLI command (module-level so spawned ranks can unpickle it).

Each task builds its `ProcessGroups` and `ModelRunner`, runs, and returns its result on
rank 0 only (None elsewhere), so nothing large travels back from other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from cpmoe.engine.options import EngineOptions, prepare_runner
from cpmoe.cp.kv_capacity import kv_slots_needed
from cpmoe.engine.generate import generate
from cpmoe.engine.runner import ModelRunner
from cpmoe.engine.sampling import SamplingParams
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class RunSpec:
    model_dir: Path
    layout: ParallelLayout
    dtype: torch.dtype
    progress: bool = True
    options: EngineOptions = EngineOptions()


def build_runner(info: RankInfo, spec: RunSpec) -> ModelRunner:
    groups = ProcessGroups.build(spec.layout, info.rank, info.device)
    return ModelRunner(spec.model_dir, groups, spec.dtype, show_progress=spec.progress,
                       load_format=spec.options.load_format,
                       quantization=spec.options.quantization)


def prefill_task(info: RankInfo, spec: RunSpec, seqs: list[list[int]]
                 ) -> list[torch.Tensor] | None:
    runner = build_runner(info, spec)
    logits = runner.prefill(seqs).cpu()
    if info.rank != 0:
        return None
    lens = [len(s) for s in seqs]
    return list(logits.split(lens))


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    weight_bytes: list[int]  # per rank
    kv_bytes_per_token: list[int]  # per rank, per token that rank stores
    kv_capacity: int
    graph_bytes: int  # CUDA-graph memory of rank 0
    prefill_s: float
    decode_s: float
    decode_steps: int
    fp8_bytes: list[int] = field(default_factory=list)  # per rank: FP8 weights + scales


def generate_task(info: RankInfo, spec: RunSpec, prompts: list[list[int]],
                  max_new_tokens: int, eos_ids: tuple[int, ...], sampling: SamplingParams
                  ) -> GenerateResult | None:
    runner = build_runner(info, spec)
    opts, layout = spec.options, spec.layout
    need = kv_slots_needed([len(p) for p in prompts], max_new_tokens, layout.attn_cp_size,
                           layout.cp_strategy, opts.page_size, opts.chunked_prefill_size)
    sizes = prepare_runner(runner, opts, need)
    out = generate(runner, prompts, max_new_tokens, eos_ids, sampling, options=opts)
    from cpmoe.quant.modules import fp8_weight_bytes
    mem = torch.tensor([runner.weight_bytes(), runner.kv.bytes_per_token(),
                        fp8_weight_bytes(runner.model)], device=info.device)
    per_rank = runner.gather_from_ranks(mem)
    if info.rank != 0:
        return None
    t = runner.times
    return GenerateResult(out, [int(m[0]) for m in per_rank], [int(m[1]) for m in per_rank],
                          sizes["kv_capacity"], sizes["graph_bytes"], t.prefill_s, t.decode_s,
                          t.decode_steps, [int(m[2]) for m in per_rank])
