"""Where the fused kernels run and how a decode step's kernels are launched.

- `use_triton(x)`: whether the Triton kernels take x (CUDA, or the CPU interpreter under
  TRITON_INTERPRET=1); else every op runs its torch reference.
- `pdl_args(x)` and `wait_for_producer(PDL)`: programmatic dependent launch, for the
  kernels of a decode step (see `pdl_args`).
- `tuned(kernel)`: a decode kernel's tiles from $CPMOE_DECODE_KERNELS_CONFIG, if set.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from cpmoe._triton import import_triton

triton, tl = import_triton()  # None on CPU-only torch without the interpreter


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ---- programmatic dependent launch ------------------------------------------------------

def pdl_args(x: torch.Tensor) -> dict:
    """Launch arguments of a kernel that starts with `wait_for_producer`: on a Hopper or newer
    GPU {"PDL": True, "launch_pdl": True}, else {"PDL": False}. Launched so (programmatic
    dependent launch), the kernel's programs may be placed on the SMs while the kernel
    before it in the stream still runs (once that one's programs have all passed their own
    wait) and start the moment it completes: the launch and its ramp overlap the tail of the
    kernel before. Graph capture keeps the dependency. On the H200 at Qwen3-30B-A3B's shape
    (bench-one-batch, uniform routing, input 1,024, 91a246a) a decode step took 3.53 ms
    against 3.73 at batch 1 in bf16 and 3.19 against 3.48 in FP8; at batch 64, which reads
    weights for most of its time, 17.18 against 17.37 and 12.02 against 12.03. Programs that
    also asked L2 for their first weight lines before the wait were no faster and were
    dropped. $CPMOE_PDL=0 turns it off (`PDL_ENABLED`, read at import; its ranks inherit
    it)."""
    if PDL_ENABLED and x.is_cuda and _pdl_device(x.device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


# read once: pdl_args runs at every launch of an eager decode step (~600 a step)
PDL_ENABLED = os.environ.get("CPMOE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int | None) -> bool:
    """Hopper or newer NVIDIA GPU, and a Triton that has grid dependency control."""
    if getattr(torch.version, "hip", None) is not None or triton is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    major = torch.cuda.get_device_capability(index)[0]
    return (major >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
            and "launch_pdl" in CUDAOptions.__dataclass_fields__)


if triton is not None:
    @triton.jit
    def wait_for_producer(PDL: tl.constexpr):
        """The first statement of a kernel launched with `pdl_args`: with PDL, wait until the
        kernel before it in the stream has completed and its writes are visible (nothing of
        this kernel reads or writes global memory before), then let the kernel after it be
        placed. Kernels that wait first in every program keep the stream's order: each
        completes only after the one before it."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


# ---- tuned tiles -----------------------------------------------------------------------------

TUNED_ENV = "CPMOE_DECODE_KERNELS_CONFIG"
# the kernels a tuned file may set, and their fields: the decode experts' W8A8 GEMMs
# (fused_moe.gemm_config), decode attention's stage 1 on FP8 and on 16-bit pools
# (paged_attention.stage1_config)
_EXPERTS = {"BLOCK_N": int, "BLOCK_K": int, "TMA_W": bool, "TILES": int, "QUANT_OUT": bool,
            "num_warps": int, "num_stages": int}
_ATTENTION = {"BLOCK_N": int, "PAGE_IDS": int, "num_warps": int, "num_stages": int,
              "PROGRAMS_PER_SM": int}
# the skinny FP8 GEMM of the decode projections (fp8_gemm.skinny_config; its K split by the
# rule there)
_SKINNY = {"BLOCK_N": int, "num_warps": int, "num_stages": int}
TUNABLE = {"gate_up": _EXPERTS, "down": _EXPERTS, "attention_fp8": _ATTENTION,
           "attention_16bit": _ATTENTION, "skinny": _SKINNY}


def tuned(kernel: str) -> dict:
    """The fields $CPMOE_DECODE_KERNELS_CONFIG sets for `kernel` (a TUNABLE key; {} when
    unset): a JSON file {kernel: {field: value}} whose values replace the built-in choice, as
    SGLang's and vLLM's tuned fused-MoE config files do; for tile sweeps of whole decode
    steps. Read once; a bad file, kernel, field or value exits in one line."""
    return _tuned_file().get(kernel, {})


@functools.cache
def _tuned_file() -> dict[str, dict]:
    path = os.environ.get(TUNED_ENV)
    if not path:
        return {}
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{TUNED_ENV}={path}: expected a JSON file, {type(e).__name__}: {e}")
    if not isinstance(spec, dict) or set(spec) - set(TUNABLE):
        raise SystemExit(f"{TUNED_ENV}={path}: expected an object with keys among "
                         f"{sorted(TUNABLE)}, got "
                         f"{sorted(spec) if isinstance(spec, dict) else type(spec).__name__}")
    for kernel, fields in spec.items():
        types = TUNABLE[kernel]
        bad = ({k: v for k, v in fields.items() if k not in types or type(v) is not types[k]}
               if isinstance(fields, dict) else fields)
        if bad:
            raise SystemExit(f"{TUNED_ENV}={path}: {kernel}: expected fields of "
                             f"{ {k: t.__name__ for k, t in types.items()} }, got {bad}")
        for field, value in fields.items():
            if type(value) is int and not _in_range(kernel, field, value):
                raise SystemExit(f"{TUNED_ENV}={path}: {kernel}.{field}: expected "
                                 f"{_expected(kernel, field)}, got {value}")
    return spec


# tile sizes are powers of two of at least 16 (Triton's block shapes; tl.dot's least
# operand side), warps and PAGE_IDS powers of two; the experts' column tiles divide the
# weights' 128-column scale blocks (fused_moe._gemm's condition)
_RANGES = {"BLOCK_N": (16, None), "BLOCK_K": (16, None), "num_warps": (1, None),
           "PAGE_IDS": (0, None)}
_KERNEL_RANGES = {("gate_up", "BLOCK_N"): (16, 128), ("down", "BLOCK_N"): (16, 128)}


def _bounds(kernel: str, field: str) -> tuple[int, int | None] | None:
    """(least, most) of a power-of-two field, None for a field that is any positive int"""
    return _KERNEL_RANGES.get((kernel, field), _RANGES.get(field))


def _expected(kernel: str, field: str) -> str:
    bounds = _bounds(kernel, field)
    if bounds is None:
        return "a positive integer"
    least, most = bounds
    text = "0 or a power of two" if least == 0 else "a power of two"
    text += f" of at least {least}" if least > 1 else ""
    return text + (f" and at most {most}" if most else "")


def _in_range(kernel: str, field: str, value: int) -> bool:
    bounds = _bounds(kernel, field)
    if bounds is None:
        return value > 0
    least, most = bounds
    if least == 0 and value == 0:
        return True
    return (value > 0 and value & (value - 1) == 0 and value >= least
            and (most is None or value <= most))
