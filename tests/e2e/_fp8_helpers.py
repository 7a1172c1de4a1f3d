"""Tiny FP8 checkpoints in exactly the hub layouts, and their independent dequantization.

`write_fp8_checkpoint` takes an HF model saved by `save_pretrained` and rewrites its
projections the way Qwen3-30B-A3B-FP8 ships them: `X.weight` float8_e4m3fn and
`X.weight_scale_inv` float32 [ceil(out/bn), ceil(in/bk)], W = q * s per block, with a
`quantization_config` in config.json (lm_head and routers listed in modules_to_not_convert,
stored in float32 here). It returns the dequantized float32 state dict, computed block by
block with plain loops (not cpmoe's code), which the tests load into the HF model as the
reference.

Variants of the tiny Qwen models (tests/conftest.py) for FP8:
    divides     hidden 64, moe_intermediate 128, blocks [32, 32]: every dim a multiple
    partial     Qwen3: hidden 72, blocks [16, 8] (hidden rows end in a half block);
                Qwen2 (head_dim 8): blocks [8, 8], shared expert 44 wide (its rows and
                columns end in a half block). Every layout of the matrix cuts on block
                boundaries (KV heads of 16 / 8 rows, MoE-TP pieces of 16 at tp 8).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0

VARIANTS = {
    ("qwen3_moe", "divides"): (dict(moe_intermediate_size=128), [32, 32]),
    ("qwen2_moe", "divides"): (dict(moe_intermediate_size=128,
                                    shared_expert_intermediate_size=64), [32, 32]),
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
