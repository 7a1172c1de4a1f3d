"""Stream an HF safetensors checkpoint into one rank's model shard, and prove it complete.

Reads `model.safetensors` or the shards named by `model.safetensors.index.json`, one tensor
at a time, and only the slices this rank owns (`safe_open(...).get_slice`). Names map to
parameters through one table: a parameter of the same name (sharded as its `Linear.shard`
says), or a hub per-expert tensor `...mlp.experts.<e>.<gate|up|down>_proj.weight` placed into
the fused local expert tensors (skipped when expert e lives on another EP rank).

At the end every parameter must have been filled exactly once, and every checkpoint tensor
must have been either used or owned by another rank; otherwise one line names the tensor.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from tqdm import tqdm

from cpmoe.models.layers import Linear
from cpmoe.moe.experts import LocalExperts

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.weight$")


class LoadError(RuntimeError):
    """A checkpoint that does not fit the model; one line naming the file and tensor."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise LoadError(f"{index}: unreadable index ({e})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = [model_dir / "model.safetensors"]
    for f in files:
        if not f.exists():
            raise LoadError(f"{f}: checkpoint file not found")
    return files


class _Target:
    """Where (part of) one checkpoint tensor goes: a parameter view and a source slice."""

    def __init__(self, param_name: str, region: str, dest: torch.Tensor,
                 full_shape: tuple[int, ...], src: tuple[slice, ...]) -> None:
        self.param_name, self.region, self.dest = param_name, region, dest
        self.full_shape, self.src = full_shape, src


def _linear_target(name: str, param_name: str, module: Linear, param: torch.Tensor) -> _Target:
    shard, local = module.shard, tuple(param.shape)
    if shard is None:
        return _Target(param_name, "all", param, local, ())
    kind, index, parts = shard
    if kind == "cols" and param.dim() == 1:  # bias of a row-parallel layer is replicated
        return _Target(param_name, "all", param, local, ())
    dim = 0 if kind == "rows" else 1
    n = local[dim]
    full = list(local)
    full[dim] = n * parts
    src = (slice(None),) * dim + (slice(index * n, (index + 1) * n),)
    return _Target(param_name, "all", param, tuple(full), src)


def _expert_target(name: str, m: re.Match, experts: LocalExperts, prefix: str) -> _Target | None:
    ep_rank, ep_size, tp_rank, tp_size = experts.shard
    e, E = int(m["e"]), experts.num_local_experts
    if not ep_rank * E <= e < (ep_rank + 1) * E:
        if e >= E * ep_size:
            raise LoadError(f"tensor {name!r}: expert {e} out of range (model has {E * ep_size})")
        return None  # another EP rank's expert
    le = e - ep_rank * E
    I = experts.down_proj.shape[2]
    H = experts.down_proj.shape[1]
    rows = slice(tp_rank * I, (tp_rank + 1) * I)
    if m["proj"] == "down_proj":
        return _Target(f"{prefix}.down_proj", f"{le}", experts.down_proj[le],
                       (H, I * tp_size), (slice(None), rows))
    half = 0 if m["proj"] == "gate_proj" else 1
    dest = experts.gate_up_proj[le, half * I:(half + 1) * I]
    return _Target(f"{prefix}.gate_up_proj", f"{le}.{half}", dest, (I * tp_size, H), (rows,))


def _resolve(name: str, params: dict[str, torch.Tensor], modules: dict[str, nn.Module],
             tied: bool) -> _Target | None | str:
    """-> a target, None (tensor belongs to another rank), or 'unexpected'."""
    m = _EXPERT.match(name)
    if m:
        experts = modules.get(m["prefix"])
        if isinstance(experts, LocalExperts):
            return _expert_target(name, m, experts, m["prefix"])
        return "unexpected"
    if name == "lm_head.weight" and tied:
        return None  # tied to embed_tokens; the checkpoint may carry a copy
    if name not in params:
        return "unexpected"
    module_name, _, _ = name.rpartition(".")
    module = modules.get(module_name)
    if isinstance(module, Linear):
        return _linear_target(name, name, module, params[name])
    return _Target(name, "all", params[name], tuple(params[name].shape), ())


def load_checkpoint(model: nn.Module, model_dir: Path, *, show_progress: bool = True,
                    tied_embeddings: bool = False) -> dict[str, int]:
    """Fill `model` from `model_dir`; returns counts {'loaded', 'skipped', 'bytes'}."""
    handles = []
    for f in checkpoint_files(model_dir):
        try:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        except Exception as e:  # safetensors raises several types for corrupt headers
            raise LoadError(f"{f}: unreadable safetensors file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return fill_parameters(model, handles, str(model_dir), show_progress=show_progress,
                           tied_embeddings=tied_embeddings)


def _progress_bar(total: int, show: bool) -> tqdm | None:
    """A bar on a terminal only: a log would keep its first frame (0%) and look stuck. It
    takes a thread lock: tqdm's default one is a multiprocessing semaphore, which a rank
    killed mid-load (a peer failed) leaks, and the resource tracker then warns at exit."""
    if not (show and sys.stderr.isatty()):
        return None
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc="loading weights", unit="tensor", leave=False)


def fill_parameters(model: nn.Module, handles: list, where: str, *, show_progress: bool,
                    tied_embeddings: bool) -> dict[str, int]:
    """Fill `model` from (path, handle) pairs; a handle has `keys()` and `get_slice(name)`
    (a safetensors file, or any source of full-shape tensors such as random weights)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    # Models whose checkpoints use other names map them to parameter names (DeepSeek-V4).
    rename = getattr(model, "checkpoint_param_name", None) or (lambda n: n)
    filled: dict[str, int] = defaultdict(int)
    regions: set[tuple[str, str]] = set()
    stats = {"loaded": 0, "skipped": 0, "bytes": 0}
    total = sum(len(h.keys()) for _, h in handles)
    bar = _progress_bar(total, show_progress)
    with torch.no_grad():
        for f, handle in handles:
            for name in handle.keys():
                if bar is not None:
                    bar.update(1)
                target = _resolve(rename(name), params, modules, tied_embeddings)
                if target == "unexpected":
                    raise LoadError(f"{f.name}: unexpected tensor {name!r} (no such parameter "
                                    f"in {type(model).__name__})")
                if target is None:
                    stats["skipped"] += 1
                    continue
                _copy(handle, f, name, target, regions, filled)
                stats["loaded"] += 1
                stats["bytes"] += target.dest.numel() * target.dest.element_size()
    if bar is not None:
        bar.close()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        names = _missing_tensor_names(missing, modules, regions)
        raise LoadError(f"{where}: checkpoint lacks {len(names)} tensor(s), first: "
                        f"{names[0]!r}")
    return stats


def _missing_tensor_names(missing: list[str], modules: dict[str, nn.Module],
                          regions: set[tuple[str, str]]) -> list[str]:
    """Checkpoint names of unfilled parameters (hub per-expert names for fused experts)."""
    names = []
    for param in missing:
        prefix, _, attr = param.rpartition(".")
        experts = modules.get(prefix)
        if not isinstance(experts, LocalExperts):
            names.append(param)
            continue
        first = experts.shard[0] * experts.num_local_experts
        for le in range(experts.num_local_experts):
            wanted = ([(f"{le}", "down_proj")] if attr == "down_proj" else
                      [(f"{le}.0", "gate_proj"), (f"{le}.1", "up_proj")])
            names += [f"{prefix}.{first + le}.{proj}.weight" for region, proj in wanted
                      if (param, region) not in regions]
    return names


def _copy(handle, f: Path, name: str, t: _Target, regions: set, filled: dict) -> None:
    sl = handle.get_slice(name)
    shape = tuple(sl.get_shape())
    if shape != t.full_shape:
        raise LoadError(f"{f.name}: tensor {name!r} has shape {list(shape)}, expected "
                        f"{list(t.full_shape)}")
    key = (t.param_name, t.region)
    if key in regions:
        raise LoadError(f"{f.name}: tensor {name!r} fills {t.param_name} a second time")
    regions.add(key)
    data = sl[t.src] if t.src else sl[:]
    if tuple(data.shape) != tuple(t.dest.shape):
        raise LoadError(f"{f.name}: tensor {name!r} slice {list(data.shape)} does not fit "
                        f"{t.param_name} {list(t.dest.shape)}")
    t.dest.copy_(data.to(t.dest.dtype))
    filled[t.param_name] += t.dest.numel()
