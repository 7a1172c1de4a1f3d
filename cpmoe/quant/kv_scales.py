"""K/V-cache scales of FP8 checkpoints: one per-tensor k_scale and v_scale per attention layer,
used by FP8 K/V pools (`--kv-cache-dtype fp8_e4m3` / `fp8_e5m2`).

A scale s means the pool stores x / s rounded to FP8 and every reader multiplies by s, so a
layer whose keys reach past e4m3's 448 keeps them instead of saturating (and small ones keep
their precision). The names read are the ones vLLM and SGLang read:

- `<attn>.k_scale`, `<attn>.v_scale` (llm-compressor / compressed-tensors `kv_cache_scheme`);
- `<attn>.k_proj.k_scale`, `<attn>.v_proj.v_scale` (NVIDIA ModelOpt);
- `<attn>.kv_scale`, one scale for both (older FP8 checkpoints).

`<attn>` is an attention module with a `kv_scale` buffer ([4] float32: k_scale, v_scale and
their reciprocals, `ops.norm`). A scale must be one positive finite number; a layer may not
get one twice; either every attention layer gets both scales or none does (a checkpoint with
some is incomplete). Each check fails with one line naming the file and the tensor. A model
without K/V pools (DeepSeek-V4 keeps its own cache) refuses such tensors by name.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn as nn

from cpmoe.ops import fill_kv_scale

_NAME = re.compile(r"^(?P<attn>.+?)\.(?:(?P<proj>[kv])_proj\.(?P=proj)_scale"
                   r"|(?P<which>kv|k|v)_scale)$")
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class KVScales:
    """The K/V-cache scales of one load: `claim` each checkpoint name, `install` at the end."""

    def __init__(self, model: nn.Module, error: type[Exception]) -> None:
        self.model = model
        self.modules = dict(model.named_modules())
        self.error = error  # the loader's error type (one line)
        self.found: dict[str, dict[str, tuple[float, str]]] = {}  # attn -> k/v -> (s, name)

    def claim(self, handle, f: Path, name: str, param_name: str) -> bool:
        """Read `name` (`param_name` once the model's renaming is applied) if it is a
        K/V-cache scale -> whether it was one."""
        m = _NAME.match(param_name)
        if m is None or m["attn"] not in self.modules:
            return False
        if not isinstance(getattr(self.modules[m["attn"]], "kv_scale", None), torch.Tensor):
            raise self.error(f"{f.name}: tensor {name!r} is a K/V-cache scale, but "
                             f"{type(self.model).__name__} keeps no K/V pools there "
                             f"(--kv-cache-dtype does not apply to it)")
        which = m["proj"] or m["which"]
        value = self._value(handle, f, name)
        got = self.found.setdefault(m["attn"], {})
        for part in ("k", "v") if which == "kv" else (which,):
            if part in got:
                raise self.error(f"{f.name}: tensor {name!r} gives {m['attn']} a second "
                                 f"{part}_scale (first: {got[part][1]!r})")
            got[part] = (value, name)
        return True

    def _value(self, handle, f: Path, name: str) -> float:
        sl = handle.get_slice(name)
        shape = list(sl.get_shape())
        dtype = sl.get_dtype() if hasattr(sl, "get_dtype") else "F32"
        if math.prod(shape) != 1 or dtype not in _FLOAT_DTYPES:
            raise self.error(f"{f.name}: K/V-cache scale {name!r} is {dtype} {shape}, "
                             f"expected one float (a per-tensor scale)")
        # a 0-d tensor cannot be sliced: safetensors handles read it whole
        data = handle.get_tensor(name) if hasattr(handle, "get_tensor") else sl[:]
        value = float(data.reshape(()).float())
        if not (math.isfinite(value) and value > 0):
            raise self.error(f"{f.name}: K/V-cache scale {name!r} is {value}, expected a "
                             f"positive finite number")
        return value

    def install(self, where: str) -> int:
        """Write the scales into the attention modules -> the layers that got them."""
        if not self.found:
            return 0
        layers = [n for n, m in self.modules.items()
                  if isinstance(getattr(m, "kv_scale", None), torch.Tensor)]
        for attn in layers:
            got = self.found.get(attn, {})
            for part in ("k", "v"):
                if part not in got:
                    have = sum(len(g) for g in self.found.values())
                    raise self.error(f"{where}: checkpoint has {have} K/V-cache scale(s) but "
                                     f"none for {attn}.{part}_scale (every attention layer "
                                     f"needs k_scale and v_scale, or none may have them)")
            fill_kv_scale(self.modules[attn].kv_scale, got["k"][0], got["v"][0])
        return len(layers)
