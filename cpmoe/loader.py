"""Stream an HF safetensors checkpoint into one rank's model shard, and prove it complete.

Reads `model.safetensors` or the shards named by `model.safetensors.index.json`, one tensor
at a time, and only the slices this rank owns (`safe_open(...).get_slice`). Names map to
parameters through one table: a parameter of the same name (sharded as its `Linear.shard`
says), or a hub per-expert tensor `...mlp.experts.<e>.<gate|up|down>_proj.weight` placed into
the fused local expert tensors (skipped when expert e lives on another EP rank).

FP8 checkpoints (see quant/formats.py): a `X.weight` in float8_e4m3fn (or packed MXFP4)
comes with its scale grid `X.weight_scale_inv` or `X.scale`; the rank's slice of the weight
is read with the slice of the grid covering it and dequantized once, here, into the
parameter's dtype. Every scale must belong to a weight, every FP8 weight must have one.

K/V-cache scales (`self_attn.k_scale` / `v_scale` and the other names in quant/kv_scales.py)
go into the attention modules' `kv_scale` buffers, for FP8 K/V pools.

At the end every parameter must have been filled exactly once, and every checkpoint tensor
(scales included) must have been either used or owned by another rank; otherwise one line
names the tensor.
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

from cpmoe.config import Fp8Config
from cpmoe.linear import Linear
from cpmoe.moe.experts import LocalExperts
from cpmoe.ops.fp8 import (FP4_NAMES, FP8_NAMES, MXFP4_BLOCK, dequantize, scale_grid,
                           scale_to_float)
from cpmoe.quant.kv_scales import KVScales

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


def quantized_weight_names(model_dir: Path) -> set[str]:
    """Checkpoint names of the weights that come with a block scale (headers only)."""
    keys: set[str] = set()
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            keys |= set(h.keys())
    out = set()
    for k in keys:
        if k.endswith(".weight_scale_inv"):
            out.add(k.removesuffix("_scale_inv"))
        elif k.endswith(".scale") and k.removesuffix(".scale") + ".weight" in keys:
            out.add(k.removesuffix(".scale") + ".weight")
    return out


class _Target:
    """Where (part of) one checkpoint tensor goes: a parameter view and a source slice."""

    def __init__(self, param_name: str, region: str, dest: torch.Tensor,
                 full_shape: tuple[int, ...], src: tuple[slice, ...],
                 scale: tuple[str, torch.Tensor] | None = None) -> None:
        self.param_name, self.region, self.dest = param_name, region, dest
        self.full_shape, self.src = full_shape, src
        self.scale = scale  # FP8 parameters: (scale parameter name, its view to fill)


def _linear_target(name: str, param_name: str, module: Linear, param: torch.Tensor) -> _Target:
    shard, local = module.shard, tuple(param.shape)
    scale = ((f"{param_name}_scale_inv", module.weight_scale_inv)
             if param.dtype == torch.float8_e4m3fn else None)
    if shard is None:
        return _Target(param_name, "all", param, local, (), scale)
    kind, index, parts = shard
    if kind == "cols" and param.dim() == 1:  # bias of a row-parallel layer is replicated
        return _Target(param_name, "all", param, local, ())
    dim = 0 if kind == "rows" else 1
    n = local[dim]
    full = list(local)
    full[dim] = n * parts
    src = (slice(None),) * dim + (slice(index * n, (index + 1) * n),)
    return _Target(param_name, "all", param, tuple(full), src, scale)


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
    fp8 = experts.gate_up_proj.dtype == torch.float8_e4m3fn
    if m["proj"] == "down_proj":
        scale = (f"{prefix}.down_scale_inv", experts.down_scale_inv[le]) if fp8 else None
        return _Target(f"{prefix}.down_proj", f"{le}", experts.down_proj[le],
                       (H, I * tp_size), (slice(None), rows), scale)
    half = 0 if m["proj"] == "gate_proj" else 1
    dest = experts.gate_up_proj[le, half * I:(half + 1) * I]
    scale = None
    if fp8:
        ib = I // experts.fp8_block[0]
        scale = (f"{prefix}.gate_up_scale_inv",
                 experts.gate_up_scale_inv[le, half * ib:(half + 1) * ib])
    return _Target(f"{prefix}.gate_up_proj", f"{le}.{half}", dest, (I * tp_size, H), (rows,),
                   scale)


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
                    tied_embeddings: bool = False,
                    quantization: Fp8Config | None = None) -> dict[str, int]:
    """Fill `model` from `model_dir`; returns counts {'loaded', 'skipped', 'bytes',
    'scales', 'kv_scales'} (scales: block-scale tensors read with their weights; kv_scales:
    attention layers given K/V-cache scales)."""
    handles = []
    for f in checkpoint_files(model_dir):
        try:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        except Exception as e:  # safetensors raises several types for corrupt headers
            raise LoadError(f"{f}: unreadable safetensors file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return fill_parameters(model, handles, str(model_dir), show_progress=show_progress,
                           tied_embeddings=tied_embeddings, quantization=quantization)


def _scale_pairs(index: dict[str, tuple[Path, object]], quant: Fp8Config | None,
                 where: str) -> dict[str, str]:
    """weight name -> its scale tensor's name, for every scale in the checkpoint."""
    pairs: dict[str, str] = {}
    for name, (f, _) in index.items():
        if name.endswith(".weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
        elif name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in index:
            weight = name.removesuffix(".scale") + ".weight"
        else:
            continue
        if weight not in index:
            raise LoadError(f"{f.name}: scale tensor {name!r} has no weight {weight!r}")
        if weight in pairs:
            raise LoadError(f"{f.name}: weight {weight!r} has two scales, {pairs[weight]!r} "
                            f"and {name!r}")
        if quant is None:
            raise LoadError(f"{f.name}: tensor {name!r} is a block scale, but {where}/"
                            f"config.json has no quantization_config")
        pairs[weight] = name
    return pairs


def _progress_bar(total: int, show: bool) -> tqdm | None:
    """A bar on a terminal only: a log would keep its first frame (0%) and look stuck. It
    takes a thread lock: tqdm's default one is a multiprocessing semaphore, which a rank
    killed mid-load (a peer failed) leaks, and the resource tracker then warns at exit."""
    if not (show and sys.stderr.isatty()):
        return None
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc="loading weights", unit="tensor", leave=False)


def fill_parameters(model: nn.Module, handles: list, where: str, *, show_progress: bool,
                    tied_embeddings: bool, quantization: Fp8Config | None = None
                    ) -> dict[str, int]:
    """Fill `model` from (path, handle) pairs; a handle has `keys()` and `get_slice(name)`
    (a safetensors file, or any source of full-shape tensors such as random weights)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    # Models whose checkpoints use other names map them to parameter names (DeepSeek-V4).
    rename = model.checkpoint_param_name
    filled: dict[str, int] = defaultdict(int)
    regions: set[tuple[str, str]] = set()
    stats = {"loaded": 0, "skipped": 0, "bytes": 0, "scales": 0, "kv_scales": 0}
    kv_scales = KVScales(model, LoadError)
    index = {name: (f, h) for f, h in handles for name in h.keys()}
    scale_of = _scale_pairs(index, quantization, where)
    scales = set(scale_of.values())
    block = quantization.block if quantization is not None else (0, 0)
    bar = _progress_bar(len(index), show_progress)
    with torch.no_grad():
        for f, handle in handles:
            for name in handle.keys():
                if bar is not None:
                    bar.update(1)
                if name in scales:  # read with its weight
                    continue
                if kv_scales.claim(handle, f, name, rename(name)):
                    continue
                target = _resolve(rename(name), params, modules, tied_embeddings)
                if target == "unexpected":
                    raise LoadError(f"{f.name}: unexpected tensor {name!r} (no such parameter "
                                    f"in {type(model).__name__})")
                scale = scale_of.get(name)
                if target is None:
                    stats["skipped"] += 1 + (scale is not None)
                    continue
                if scale is None:
                    _copy(handle, f, name, target, regions, filled)
                else:
                    sf, sh = index[scale]
                    _copy_quantized(handle, f, name, sh, sf, scale, block, target, regions,
                                    filled)
                    stats["scales"] += 1
                stats["loaded"] += 1
                stats["bytes"] += target.dest.numel() * target.dest.element_size()
    if bar is not None:
        bar.close()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        names = _missing_tensor_names(missing, modules, regions)
        raise LoadError(f"{where}: checkpoint lacks {len(names)} tensor(s), first: "
                        f"{names[0]!r}")
    stats["kv_scales"] = kv_scales.install(where)
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


def _dtype_name(sl) -> str | None:
    get = getattr(sl, "get_dtype", None)  # random-weight sources have none (never FP8)
    return get() if get is not None else None


def _copy(handle, f: Path, name: str, t: _Target, regions: set, filled: dict) -> None:
    sl = handle.get_slice(name)
    if _dtype_name(sl) in FP8_NAMES:
        raise LoadError(f"{f.name}: tensor {name!r} is float8_e4m3fn but the checkpoint has "
                        f"no scale for it ({name.removesuffix('.weight')}.weight_scale_inv "
                        f"or .scale)")
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


def _block_slice(src: slice, size: int, block: int) -> tuple[slice, slice, int]:
    """A cut [a, b) of a dim of `size` -> (the same cut, the scale rows covering it, the
    offset of a inside its block)."""
    a, b, _ = src.indices(size)
    return slice(a, b), slice(a // block, -(-b // block)), a % block


def _copy_quantized(handle, f: Path, name: str, scale_handle, scale_file: Path, scale: str,
                    fp8_block: tuple[int, int], t: _Target, regions: set, filled: dict) -> None:
    """Read this rank's slice of a block-quantized weight and of its scale grid, and store
    the dequantized slice."""
    sl, ssl = handle.get_slice(name), scale_handle.get_slice(scale)
    dtype = _dtype_name(sl)
    shape = tuple(sl.get_shape())
    fp4 = dtype in FP4_NAMES
    if dtype not in FP8_NAMES and not fp4:
        raise LoadError(f"{f.name}: tensor {name!r} has a scale ({scale!r}) but dtype {dtype}, "
                        f"expected F8_E4M3 (float8_e4m3fn) or packed MXFP4 (I8/U8)")
    if len(shape) != 2:
        raise LoadError(f"{f.name}: quantized tensor {name!r} has shape {list(shape)}, "
                        f"expected a 2-D weight")
    logical = (shape[0], 2 * shape[1]) if fp4 else shape
    if logical != t.full_shape:
        packed = f" (MXFP4: {list(shape)} packed two per byte)" if fp4 else ""
        raise LoadError(f"{f.name}: tensor {name!r} has shape {list(logical)}{packed}, "
                        f"expected {list(t.full_shape)}")
    block = MXFP4_BLOCK if fp4 else fp8_block
    want = scale_grid(logical, block)
    if tuple(ssl.get_shape()) != want:
        raise LoadError(f"{scale_file.name}: scale {scale!r} has shape "
                        f"{list(ssl.get_shape())}, expected {list(want)} (weight {name!r} "
                        f"{list(logical)} in blocks {list(block)})")
    key = (t.param_name, t.region)
    if key in regions:
        raise LoadError(f"{f.name}: tensor {name!r} fills {t.param_name} a second time")
    regions.add(key)
    src = tuple(t.src) + (slice(None),) * (2 - len(t.src))
    rows, srows, r_off = _block_slice(src[0], logical[0], block[0])
    cols, scols, c_off = _block_slice(src[1], logical[1], block[1])
    if fp4:
        if cols.start % 2 or cols.stop % 2:
            raise LoadError(f"{f.name}: MXFP4 tensor {name!r} cut at an odd column "
                            f"{cols.start}")
        cols = slice(cols.start // 2, cols.stop // 2)
    if t.dest.dtype == torch.float8_e4m3fn:  # FP8 compute: weights and scales as stored
        _copy_fp8(f, name, scale, sl[rows, cols], ssl[srows, scols], (r_off, c_off), fp4, t,
                  filled)
        return
    data = dequantize(sl[rows, cols], ssl[srows, scols], block, (r_off, c_off))
    if tuple(data.shape) != tuple(t.dest.shape):
        raise LoadError(f"{f.name}: tensor {name!r} slice {list(data.shape)} does not fit "
                        f"{t.param_name} {list(t.dest.shape)}")
    t.dest.copy_(data.to(t.dest.dtype))
    filled[t.param_name] += t.dest.numel()


def _copy_fp8(f: Path, name: str, scale: str, q: torch.Tensor, s: torch.Tensor,
              offset: tuple[int, int], fp4: bool, t: _Target, filled: dict) -> None:
    assert t.scale is not None
    scale_param, scale_dest = t.scale
    if fp4 or offset != (0, 0) or tuple(q.shape) != tuple(t.dest.shape) \
            or tuple(s.shape) != tuple(scale_dest.shape):
        raise LoadError(f"{f.name}: tensor {name!r} (slice {list(q.shape)}, scale "
                        f"{list(s.shape)}) does not fit the FP8 parameter {t.param_name} "
                        f"{list(t.dest.shape)} with scale {list(scale_dest.shape)}")
    t.dest.copy_(q.view(torch.float8_e4m3fn) if q.dtype != torch.float8_e4m3fn else q)
    scale_dest.copy_(scale_to_float(s))
    filled[t.param_name] += t.dest.numel()
    filled[scale_param] += scale_dest.numel()
