"""DeepSeek-V4 test helpers: tiny random checkpoints written by transformers, and the rank
task the CP tests run (module-level, so spawned ranks can import it).

Checkpoints are float32 with a fixed seed. Every parameter HF initialises to a constant
(attention sinks, position biases, hyper-connection bases and scales, correction biases,
hash tables) gets random values, so a loader that drops or swaps one is caught by values.
Routers are scaled so top-k routing is decisive (no near-ties a different layout's fp32
rounding could flip). The sizes put 600 tokens past the HCA rate (128) four times and the
CSA entry count (150) well past the indexer's top-k (32), with an 8-token sliding window;
CSA and HCA layers alternate around a sliding-only one.
The indexer has 2 heads, as few as a real indexer could: a score is exactly 0 wherever both
heads' q.k are negative (relu), for about 1 in 4 (query, entry) pairs, so most top-k
choices past 32 entries are made among tied zeros. transformers' `topk` picks among them by
the whole row (its length included): the tests prove that cpmoe picks what it picks, in
every batch composition and layout (`indexer.topk_as_reference`), which a
fixture with many heads would leave untested.

Variants (same seed, so they differ only where named):
    base         every branch random
    shared_only  routed experts zeroed: the MoE output is the shared expert alone
    hash_only    shared experts zeroed everywhere, routed experts zeroed in top-k layers:
                 only the hash-routed layers' experts (picked by token id) contribute
"""

from __future__ import annotations

from pathlib import Path

import torch

from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo
from cpmoe.parallel.layout import ParallelLayout

V4_CONFIG = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25,
    n_routed_experts=8, num_experts_per_tok=2, sliding_window=8, o_groups=2, o_lora_rank=16,
    index_n_heads=2, index_head_dim=16, index_topk=32, hc_mult=4, hc_sinkhorn_iters=20,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                 "sliding_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
VARIANTS = ("base", "shared_only", "hash_only")
ROUTER_STD = 0.4  # expert logits of a few units: decisive top-k


def _randomise(model: torch.nn.Module, num_experts: int, top_k: int) -> None:
    for name, p in model.named_parameters():
        if name.endswith("gate.weight"):
            p.copy_(ROUTER_STD * torch.randn_like(p))
        elif name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn_like(p))
        elif name.endswith(("sinks", "position_bias", "base")):
            p.copy_(0.5 * torch.randn_like(p))
        elif name.endswith("scale"):  # hyper-connection scales
            p.copy_(1 + 0.2 * torch.randn_like(p))
        elif name.endswith(("fn", "hc_fn")):
            p.copy_(0.1 * torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))
        elif name.endswith("tid2eid"):  # each token: top_k distinct experts
            b.copy_(torch.stack([torch.randperm(num_experts)[:top_k]
                                 for _ in range(b.shape[0])]))


def make_v4_model(variant: str = "base", out_dir: Path | None = None, seed: int = 0):
    """-> (HF DeepseekV4ForCausalLM in eval mode, dir it was saved to or None)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    assert variant in VARIANTS, variant
    cfg = DeepseekV4Config(**V4_CONFIG)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        _randomise(model, cfg.n_routed_experts, cfg.num_experts_per_tok)
        for i, layer in enumerate(model.model.layers):
            mlp = layer.mlp
            hashed = cfg.mlp_layer_types[i] == "hash_moe"
            if variant == "shared_only" or (variant == "hash_only" and not hashed):
                mlp.experts.gate_up_proj.zero_()
                mlp.experts.down_proj.zero_()
            if variant == "hash_only":
                mlp.shared_experts.down_proj.weight.zero_()
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out_dir))
    return model, out_dir


def greedy_run(groups: ProcessGroups, model_dir: Path, seqs: list[list[int]],
               new_tokens: int, calibration: list[list[int]] | None = None) -> dict:
    """Prefill logits of every position (the prefill also fills the cache), then greedy
    decoding through the runner's decode steps: tokens per sequence, every step's logits.
    With `calibration`, the experts are first re-placed by the load of those prompts."""
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    report = None
    if calibration is not None:
        runner.record_expert_load()
        runner.prefill(calibration)
        report = runner.rebalance_experts()
    runner.allocate_kv(sum(len(s) for s in seqs) + len(seqs) * new_tokens)
    keys = list(range(len(seqs)))
    prefill = runner.prefill(seqs, keys)
    steps = [prefill[torch.tensor([len(s) for s in seqs]).cumsum(0) - 1]]
    tokens = [steps[-1].argmax(-1).tolist()]
    for _ in range(new_tokens - 1):
        steps.append(runner.decode(keys, tokens[-1]))
        tokens.append(steps[-1].argmax(-1).tolist())
    return {"prefill": prefill, "steps": steps,
            "tokens": [list(t) for t in zip(*tokens)], "report": report}


def v4_task(info: RankInfo, layout: ParallelLayout, model_dirs: dict[str, Path],
            seqs: list[list[int]], new_tokens: int,
            calibration: list[list[int]] | None = None) -> dict | None:
    groups = ProcessGroups.build(layout, info.rank, info.device)
    out = {kind: greedy_run(groups, d, seqs, new_tokens, calibration)
           for kind, d in model_dirs.items()}
    return out if info.rank == 0 else None


def cache_bytes_run(groups: ProcessGroups, model_dir: Path, seq: list[int],
                    new_tokens: int) -> dict:
    """One prompt prefilled into the cache, then greedy decode steps: this rank's cache
    bytes after the prefill and after the decode, the tokens and every step's logits."""
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    runner.allocate_kv(len(seq) + new_tokens)
    logits = runner.prefill([seq], [0], last_only=True)
    after_prefill = runner.kv.nbytes_used()
    steps, tokens = [logits], [int(logits[0].argmax())]
    for _ in range(new_tokens - 1):
        steps.append(runner.decode([0], [tokens[-1]]))
        tokens.append(int(steps[-1][0].argmax()))
    return {"prefill_bytes": after_prefill, "decode_bytes": runner.kv.nbytes_used(),
            "tokens": tokens, "steps": torch.cat(steps)}


def cache_bytes_task(info: RankInfo, layout: ParallelLayout, model_dir: Path, seq: list[int],
                     new_tokens: int) -> dict:
    return cache_bytes_run(ProcessGroups.build(layout, info.rank, info.device), model_dir, seq,
                           new_tokens)


def chunked_run(groups: ProcessGroups, model_dir: Path, seqs: list[list[int]], chunk: int,
                new_tokens: int) -> dict:
    """`greedy_run`'s outputs with every prompt prefilled `chunk` tokens at a time (all
    prompts' next chunks in one extend step, each continuing its cached prefix, as the
    scheduler runs them): the prefill logits of every position in flat order, then greedy
    decode steps."""
    runner = ModelRunner(model_dir, groups, torch.float32, show_progress=False)
    runner.allocate_kv(sum(len(s) for s in seqs) + len(seqs) * new_tokens)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        segs = [Segment(i, seqs[i][done[i]:done[i] + chunk], done[i], len(seqs[i]))
                for i in live]
        out = runner.extend(segs, last_only=False)
        at = 0
        for i, seg in zip(live, segs):
            rows[i].append(out[at:at + len(seg.ids)])
            at += len(seg.ids)
            done[i] += len(seg.ids)
    prefill = torch.cat([torch.cat(r) for r in rows])
    keys = list(range(len(seqs)))
    steps = [prefill[torch.tensor([len(s) for s in seqs]).cumsum(0) - 1]]
    tokens = [steps[-1].argmax(-1).tolist()]
    for _ in range(new_tokens - 1):
        steps.append(runner.decode(keys, tokens[-1]))
        tokens.append(steps[-1].argmax(-1).tolist())
    return {"prefill": prefill, "steps": steps, "tokens": [list(t) for t in zip(*tokens)]}


def chunked_task(info: RankInfo, layout: ParallelLayout, model_dir: Path,
                 seqs: list[list[int]], chunks: list[int], new_tokens: int) -> dict | None:
    groups = ProcessGroups.build(layout, info.rank, info.device)
    out = {c: chunked_run(groups, model_dir, seqs, c, new_tokens) for c in chunks}
    return out if info.rank == 0 else None
