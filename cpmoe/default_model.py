"""Built-in tiny Qwen3-MoE checkpoint used when no ``--model`` is given.

The checkpoint is an ordinary Hugging Face directory laid out exactly like a hub Qwen3-MoE
release (``config.json``, ``model.safetensors`` with the hub tensor names, a byte-level BPE
tokenizer, ``generation_config.json``), so cpmoe's normal loader reads it like a real model.
Weights are random but deterministic: every tensor is drawn, in a fixed order, from one
``torch.Generator`` seeded with a constant. Normal-like values are built from integer draws
(an Irwin-Hall sum of uniform integers) with exact arithmetic only, because CPU ``torch.randn``
in float32 gives different bits depending on the CPU's vector unit (AVX2 vs. plain/ARM);
integer draws from the Mersenne Twister and IEEE add/divide are the same everywhere.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import sys
import time
import uuid

import torch
from safetensors.torch import save_file

DEFAULT_MODEL_NAME = "cpmoe-tiny-qwen3-moe"
_VERSION = "v2"  # v2: tensors drawn in the order of qwen_moe.checkpoint_shapes
_SEED = 20240611
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_STALE_TMP_SECONDS = 3600.0
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_UNIFORM_RANGE = 1 << 16  # each summand is uniform on {0, ..., 2**16 - 1}
_UNIFORM_TERMS = 6  # Irwin-Hall terms; 6 gives a close bell shape with tails up to ~4.2 sigma


def default_model_dir() -> pathlib.Path:
    """Return where the built-in checkpoint lives: ``$CPMOE_CACHE_DIR`` or ``~/.cache/cpmoe``."""
    root = os.environ.get("CPMOE_CACHE_DIR")
    base = pathlib.Path(root).expanduser() if root else pathlib.Path.home() / ".cache" / "cpmoe"
    return base / f"{DEFAULT_MODEL_NAME}-{_VERSION}"


def _is_complete(path: pathlib.Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in _REQUIRED_FILES)


def _remove_stale_tmp_dirs(target: pathlib.Path) -> None:
    """Delete temp dirs of crashed creators (old enough that no live creator still owns them)."""
    now = time.time()
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def ensure_default_model(progress: bool = False) -> pathlib.Path:
    """Create the checkpoint if missing and return its directory.

    Creation writes into a temporary directory next to the target and renames it into place,
    so a crash or a concurrent creator (several ranks, several test processes) never leaves or
    reads a half-written checkpoint; if the rename loses a race, the winner's copy is used.
    """
    target = default_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    if progress:
        print(f"cpmoe: creating built-in model {DEFAULT_MODEL_NAME} in {target}", file=sys.stderr)
    try:
        write_tiny_qwen3_moe(tmp)
        if target.exists() and not _is_complete(target):
            # Not ours (we only ever rename complete dirs in): move it aside, do not trust it.
            target.rename(target.parent / f".{target.name}.tmp-broken-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # the failure was not a lost race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"cpmoe: built-in model ready ({time.perf_counter() - start:.2f}s)", file=sys.stderr)
    return target


def _tiny_config(vocab_size: int, eos_id: int, overrides: dict[str, object]) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "initializer_range": 0.02, "use_cache": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 4, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "torch_dtype": "float32",
        "bos_token_id": eos_id, "eos_token_id": eos_id,
    }
    config.update(overrides)
    return config


def _normal_like(
    gen: torch.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0
) -> torch.Tensor:
    """Bell-shaped draw with the given mean and std, bit-exact on any CPU and torch version."""
    size = (_UNIFORM_TERMS, *shape)
    draws = torch.randint(0, _UNIFORM_RANGE, size, generator=gen, dtype=torch.int64)
    total = draws.sum(dim=0).to(torch.float64)  # exact: integer sum below 2**53
    center = _UNIFORM_TERMS * (_UNIFORM_RANGE - 1) / 2
    sigma = math.sqrt(_UNIFORM_TERMS * (_UNIFORM_RANGE**2 - 1) / 12)
    return ((total - center) * (std / sigma) + mean).to(torch.float32).contiguous()


def _tiny_weights(cfg: dict[str, object]) -> dict[str, torch.Tensor]:
    """Every tensor the model's own checkpoint table names (so `mlp_only_layers` and other
    overrides are honoured), drawn in that table's order from a generator seeded with
    ``_SEED``: norms around 1, the embedding with std 1, linear weights with std
    1/sqrt(fan_in), the router twice that so top-k routing is decisive, biases small."""
    from cpmoe.models.qwen_moe.config import parse_qwen_moe
    from cpmoe.models.qwen_moe.model import checkpoint_shapes

    gen = torch.Generator(device="cpu").manual_seed(_SEED)
    out: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_shapes(parse_qwen_moe(cfg)).items():
        if name.endswith("norm.weight"):
            out[name] = _normal_like(gen, shape, 0.05, mean=1.0)
        elif name == "model.embed_tokens.weight":
            out[name] = _normal_like(gen, shape, 1.0)
        elif name.endswith(".bias"):
            out[name] = _normal_like(gen, shape, 0.02)
        else:
            scale = 2.0 if name.endswith("mlp.gate.weight") else 1.0
            out[name] = _normal_like(gen, shape, scale / math.sqrt(shape[1]))
    return out


def _write_tokenizer(out_dir: pathlib.Path) -> tuple[int, int]:
    """Save the untrained byte-level BPE tokenizer; return (vocab size, eos id)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    eos = _SPECIAL_TOKENS[0]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=eos, clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(eos)


def write_tiny_qwen3_moe(out_dir: pathlib.Path, **config_overrides: object) -> None:
    """Write a complete tiny Qwen3-MoE checkpoint (config, weights, tokenizer) into ``out_dir``."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, eos_id = _write_tokenizer(out_dir)
    cfg = _tiny_config(vocab_size, eos_id, config_overrides)
    if int(cfg["vocab_size"]) < vocab_size:
        raise ValueError(f"vocab_size {cfg['vocab_size']} < tokenizer size {vocab_size}")
    save_file(_tiny_weights(cfg), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    # config.json last: a directory with a config is one whose other files are all written.
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
