"""The HF transformers baseline of `cpmoe bench`: the same shape on one device, SDPA
attention, `grouped_mm` experts, logits of the last token only, under inference mode.

The HF model gets the very weights `ModelRunner.from_config` gives cpmoe (the same seeded
full tensors by hub name; per-expert tensors placed into transformers 5's fused expert
parameters), so its logits can be checked against cpmoe's one-rank layout. If that mapping
fails (another transformers version), the model keeps HF's own random init and the report
says so. Like `model_task`, a set-up task builds the model once per pool and each length is
its own task.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass

import torch

from cpmoe.bench.model_task import prompts
from cpmoe.bench.timing import device_name, free_cached, median, peak_bytes, reset_peak, sync, timed
from cpmoe.parallel.launch import RankInfo

_MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|"
                     r"down_proj)\.weight$")


@dataclass(frozen=True)
class HFSpec:
    config: dict  # HF config.json contents
    dtype: torch.dtype
    seed: int
    batch: int
    warmup: int
    iters: int


_STATE: dict[str, object] = {}  # this rank process's HF model between tasks of one pool


def hf_config(raw: dict):
    from transformers import AutoConfig
    arch = (raw.get("architectures") or [""])[0]
    model_type = raw.get("model_type") or _MODEL_TYPES.get(arch)
    if model_type is None:
        raise ValueError(f"no HF model_type for architecture {arch!r}")
    kwargs = {k: v for k, v in raw.items()
              if k not in ("model_type", "transformers_version", "torch_dtype", "dtype")}
    return AutoConfig.for_model(model_type, **kwargs)


def build_hf_model(raw: dict, dtype: torch.dtype, device: torch.device):
    """-> (model in eval mode on device, notes). grouped_mm experts when this transformers
    takes the request; otherwise its default experts path, said in the notes."""
    from transformers import AutoModelForCausalLM
    config = hf_config(raw)
    notes = []
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation="sdpa",
                                                     experts_implementation="grouped_mm")
        except (TypeError, ValueError, ImportError) as e:
            notes.append(f"experts_implementation='grouped_mm' refused ({_one_line(e)}); "
                         f"using this transformers' default experts path")
            model = AutoModelForCausalLM.from_config(hf_config(raw), dtype=dtype,
                                                     attn_implementation="sdpa")
    return model.eval(), notes


def fill_like_cpmoe(model, raw: dict, seed: int, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Copy cpmoe's random weights (same seed, same names) into the HF model; raise if any
    HF parameter is left unfilled or a tensor has no place."""
    from cpmoe.models.random_weights import RandomCheckpoint
    from cpmoe.models.registry import config_from_dict
    cfg, model_cls = config_from_dict(raw, "<bench shape>")
    source = RandomCheckpoint.of(model_cls, cfg, seed, device, dtype)
    params = dict(model.named_parameters())
    filled: Counter = Counter()
    inter = cfg.moe_intermediate_size
    with torch.no_grad():
        for name in source.keys():  # noqa: SIM118 -- a checkpoint handle, not a dict
            full = source.get_slice(name)[...]
            m = _EXPERT.match(name)
            if m is None:
                params[name].copy_(full)
                filled[name] += full.numel()
                continue
            e = int(m["e"])
            if m["proj"] == "down_proj":
                target, dest = m["prefix"] + ".down_proj", params[m["prefix"] + ".down_proj"][e]
            else:
                target = m["prefix"] + ".gate_up_proj"
                rows = slice(0, inter) if m["proj"] == "gate_proj" else slice(inter, 2 * inter)
                dest = params[target][e, rows]
            dest.copy_(full)
            filled[target] += full.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise RuntimeError(f"HF parameters not filled from cpmoe's random weights: "
                           f"{missing[:3]}")


def setup_task(info: RankInfo, spec: HFSpec) -> dict:
    import transformers
    t0 = time.perf_counter()
    model, notes = build_hf_model(spec.config, spec.dtype, info.device)
    try:
        fill_like_cpmoe(model, spec.config, spec.seed, info.device, spec.dtype)
        same_weights = True
    except Exception as e:  # noqa: BLE001 -- another transformers layout: keep HF's init
        same_weights = False
        notes.append(f"weights: HF's own random init, not cpmoe's ({_one_line(e)})")
    sync(info.device)
    _STATE["model"] = model
    cfg = model.config
    return {"build_s": time.perf_counter() - t0, "device_name": device_name(info.device),
            "transformers": transformers.__version__, "same_weights": same_weights,
            "experts_implementation": getattr(cfg, "_experts_implementation", None),
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "notes": notes}


def length_task(info: RankInfo, spec: HFSpec, length: int, keep_logits: bool) -> dict:
    model = _STATE["model"]
    device = info.device
    vocab = spec.config["vocab_size"]
    ids = torch.tensor(prompts(vocab, length, spec.batch, spec.seed), device=device)

    def step() -> torch.Tensor:
        with torch.inference_mode():
            out = model(input_ids=ids, logits_to_keep=1, use_cache=False)
        return out.logits[:, -1].float()

    free_cached(device)
    reset_peak(device)
    for _ in range(spec.warmup):
        step()
    times = []
    logits = None
    for _ in range(spec.iters):
        logits, seconds = timed(step, device)
        times.append(seconds)
    return {"seconds_per_rank": [median(times)], "seconds_iters_rank0": times,
            "peak_bytes_per_rank": [peak_bytes(device)],
            "logits": logits.cpu() if keep_logits and logits is not None else None}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]
