"""Tiny FP8 checkpoints in exactly the hub layouts, and their independent dequantization.

`write_fp8_checkpoint` takes an HF model saved by `save_pretrained` and rewrites its
projections the way Qwen3-30B-A3B-FP8 ships them: `X.weight` float8_e4m3fn and
`X.weight_scale_inv` float32 [ceil(out/bn), ceil(in/bk)], W = q * s per block, with a
`quantization_config` in config.json (lm_head and routers listed in modules_to_not_convert,
stored in float32 here). It returns the dequantized float32 state dict, computed block by
block with plain loops (not cpmoe's code), which the tests load into the HF model as the
reference.

Variants of the tiny Qwen models (tests/conftest.py) for FP8:
    divides     hidden 64, moe_intermediate 128, blocks [32, 32]: every dim a multiple,
                but heads of 16 (Qwen3) / 8 (Qwen2) rows: attention TP cuts inside blocks
    aligned     every dim a multiple and every layout of the matrix on block boundaries:
                Qwen3 blocks [16, 16], Qwen2 (head_dim 8) blocks [8, 8]
    partial     Qwen3: hidden 72, blocks [16, 8] (hidden rows end in a half block);
                Qwen2 (head_dim 8): blocks [8, 8], shared expert 44 wide (its rows and
                columns end in a half block). Every layout of the matrix cuts on block
                boundaries (KV heads of 16 / 8 rows, MoE-TP pieces of 16 at tp 8).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0

VARIANTS = {
    ("qwen3_moe", "divides"): (dict(moe_intermediate_size=128), [32, 32]),
    ("qwen2_moe", "divides"): (dict(moe_intermediate_size=128,
                                    shared_expert_intermediate_size=64), [32, 32]),
    ("qwen3_moe", "aligned"): (dict(moe_intermediate_size=128), [16, 16]),
    ("qwen2_moe", "aligned"): (dict(moe_intermediate_size=128,
                                    shared_expert_intermediate_size=64), [8, 8]),
    ("qwen3_moe", "partial"): (dict(moe_intermediate_size=128, hidden_size=72), [16, 8]),
    ("qwen2_moe", "partial"): (dict(moe_intermediate_size=128,
                                    shared_expert_intermediate_size=44), [8, 8]),
}


def quantize_blocks(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per [bn, bk] block: s = amax / 448, q = fp8(w / s)."""
    bn, bk = block
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / bn), math.ceil(cols / bk), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            amax = part.abs().max().item()
            s[i, j] = amax / FP8_MAX if amax > 0 else 1.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (part / s[i, j]).to(
                torch.float8_e4m3fn)
    return q, s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, block: list[int]) -> torch.Tensor:
    """W = q * s, block by block (the reference; independent of cpmoe.quant)."""
    bn, bk = block
    w = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (
                q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * s[i, j].float())
    return w


def quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The projections an FP8 hub checkpoint quantizes (not the head, routers, norms)."""
    return [n for n, t in state.items() if n.endswith("_proj.weight") and t.dim() == 2]


def write_fp8_checkpoint(model_dir: Path, block: list[int], extra_config: dict | None = None
                         ) -> dict[str, torch.Tensor]:
    """Rewrite a save_pretrained directory in place as a block-FP8 checkpoint ->
    the dequantized float32 state (checkpoint names)."""
    path = Path(model_dir) / "model.safetensors"
    state = load_file(str(path))
    out, deq = {}, {}
    for name, t in state.items():
        if name in quantized_names(state):
            q, s = quantize_blocks(t, block)
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = dequantize_blocks(q, s, block)
        else:
            out[name] = deq[name] = t
    save_file(out, str(path), metadata={"format": "pt"})
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    layers = cfg["num_hidden_layers"]
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"] + [f"model.layers.{i}.mlp.gate"
                                                 for i in range(layers)],
        **(extra_config or {})}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return deq


def make_fp8_checkpoint(kind: str, variant: str, out_dir: Path):
    """-> (HF model holding the dequantized weights, FP8 checkpoint dir)."""
    from tests.conftest import make_hf_model
    overrides, block = VARIANTS[(kind, variant)]
    model, _ = make_hf_model(kind, out_dir, **overrides)
    deq = write_fp8_checkpoint(out_dir, block)
    hf_state = model.state_dict()
    with torch.no_grad():
        for name, w in deq.items():
            if name in hf_state:
                hf_state[name].copy_(w)
            else:  # hub per-expert tensors -> transformers 5's fused expert parameters
                _copy_expert(model, name, w)
    return model, out_dir


def _copy_expert(model, name: str, w: torch.Tensor) -> None:
    prefix, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
    experts = model.get_submodule(prefix)
    if proj == "down_proj":
        experts.down_proj[e].copy_(w)
        return
    inter = w.shape[0]
    half = 0 if proj == "gate_proj" else 1
    experts.gate_up_proj[e, half * inter:(half + 1) * inter].copy_(w)


def hf_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([s])).logits[0].float() for s in seqs])


# ---- DeepSeek-V4's own format -----------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
V4_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|shared_experts\.w[123])\.weight$")
V4_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def _pow2_scale(amax: float, top: float) -> int:
    """ue8m0 byte of the smallest power of two s with amax / s <= top."""
    return 127 + (math.ceil(math.log2(amax / top)) if amax > 0 else 0)


def quantize_ue8m0_blocks(w: torch.Tensor, block: list[int]):
    """Block FP8 with power-of-two scales stored as ue8m0 bytes (float8_e8m0fnu)."""
    bn, bk = block
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    e = torch.empty(math.ceil(rows / bn), math.ceil(cols / bk), dtype=torch.uint8)
    for i in range(e.shape[0]):
        for j in range(e.shape[1]):
            part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            e[i, j] = _pow2_scale(part.abs().max().item(), FP8_MAX)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (
                part / 2.0 ** (int(e[i, j]) - 127)).to(torch.float8_e4m3fn)
    return q, e.view(torch.float8_e8m0fnu)


def dequantize_ue8m0_blocks(q: torch.Tensor, e: torch.Tensor, block: list[int]) -> torch.Tensor:
    s = torch.tensor([[2.0 ** (int(b) - 127) for b in row] for row in e.view(torch.uint8)])
    return dequantize_blocks(q, s, block)


def quantize_mxfp4(w: torch.Tensor):
    """Groups of 32 inputs: a power-of-two scale (amax <= 6 s), each value rounded to the
    nearest e2m1 -> (int8 [N, K/2], low nibble = even input; float8_e8m0fnu [N, K/32])."""
    rows, cols = w.shape
    grid = torch.tensor(E2M1)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    e = torch.empty(rows, cols // 32, dtype=torch.uint8)
    for r in range(rows):
        for g in range(cols // 32):
            part = w[r, g * 32:(g + 1) * 32].float()
            e[r, g] = _pow2_scale(part.abs().max().item(), 6.0)
            x = part / 2.0 ** (int(e[r, g]) - 127)
            mag = (x.abs()[:, None] - grid[None, :]).abs().argmin(dim=1)
            codes[r, g * 32:(g + 1) * 32] = (mag | ((x < 0) & (mag > 0)).to(torch.long) * 8
                                             ).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), e.view(torch.float8_e8m0fnu)


def dequantize_mxfp4(packed: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    table = list(E2M1) + [-v for v in E2M1]
    u8 = packed.view(torch.uint8)
    rows, half = u8.shape
    w = torch.empty(rows, 2 * half)
    for r in range(rows):
        for c in range(half):
            byte = int(u8[r, c])
            scale = 2.0 ** (int(e.view(torch.uint8)[r, (2 * c) // 32]) - 127)
            w[r, 2 * c] = table[byte & 0xF] * scale
            w[r, 2 * c + 1] = table[byte >> 4] * scale
    return w


def write_v4_fp8_checkpoint(model_dir: Path, block: list[int], deq_dir: Path) -> None:
    """Rewrite a save_pretrained V4 directory in place in DeepSeek-V4's own format (FP8
    attention projections and shared experts with ue8m0 `.scale`, MXFP4 routed experts);
    deq_dir gets the independently dequantized float32 checkpoint (no quantization)."""
    path = Path(model_dir) / "model.safetensors"
    state = load_file(str(path))
    out, deq = {}, {}
    for name, t in state.items():
        base = name.removesuffix(".weight")
        if V4_FP4.search(name):
            q, e = quantize_mxfp4(t)
            out[name], out[base + ".scale"] = q, e
            deq[name] = dequantize_mxfp4(q, e)
        elif V4_FP8.search(name):
            q, e = quantize_ue8m0_blocks(t, block)
            out[name], out[base + ".scale"] = q, e
            deq[name] = dequantize_ue8m0_blocks(q, e, block)
        else:
            out[name] = deq[name] = t
    deq_dir = Path(deq_dir)
    deq_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.name != "model.safetensors":
            (deq_dir / f.name).write_bytes(f.read_bytes())
    save_file(deq, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(out, str(path), metadata={"format": "pt"})
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    cfg["expert_dtype"] = "fp4"
    cfg_path.write_text(json.dumps(cfg, indent=2))


# per layer: (k_scale, v_scale) and the names they are written under: compressed-tensors',
# ModelOpt's, and the older single kv_scale (both the same); not powers of two, so a scale
# applied on one side only, or a quotient rounded unlike the reciprocal product, shows
KV_SCALES = ((0.0173, 0.291, ("self_attn.k_scale", "self_attn.v_scale")),
             (0.77, 3.1, ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")),
             (0.137, 0.137, ("self_attn.kv_scale",)))


def with_kv_scales(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint in `src` with KV_SCALES' tensors added -> dst."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for layer, (k, v, names) in enumerate(KV_SCALES):
        for name, value in zip(names, (k, v)):
            state[f"model.layers.{layer}.{name}"] = torch.tensor(value, dtype=torch.float32)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
