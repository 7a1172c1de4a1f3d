"""Estimates of layouts for one model, prompt length and batch: memory per rank, prefill
time (TTFT), decode step time and the term that bounds each, ranked; as text or JSON.

A layout's prefill is every layer's terms (cost.prefill_layer) plus the host time before
the first layer; its decode step is every layer's decode terms plus the LM head's read, at
`batch` sequences of `length` cached tokens. Ranking: layouts whose weights and prefill
transients fit the GPU come first, then by prefill time (or decode step time with
`by_decode`, where only the KV cache must hold the sequences: a server prefills them in
chunks); ties keep the enumeration order. Memory: weights per rank are exact for a
Qwen-MoE checkpoint in bf16 (the sum `cpmoe plan` prints); KV capacity is what
`--mem-fraction-static` leaves after the weights, divided by a stored token's K/V bytes, and
a prompt token is stored on one CP rank, so the layout holds `cp` times a rank's slots.
"""

from __future__ import annotations

from cpmoe.bench.spec import layout_name
from cpmoe.estimate import cost
from cpmoe.estimate.rates import Rates
from cpmoe.parallel.layout import ParallelLayout

GIB = 2**30


def estimate(m: cost.ModelShape, layout: ParallelLayout, rates: Rates, length: int,
             batch: int = 1, imbalance: float = 1.0, mem_fraction: float = 0.85) -> dict:
    sparse_layers = m.layers - m.dense_layers
    prefill: dict[str, float] = {}
    for sparse, count in ((True, sparse_layers), (False, m.dense_layers)):
        if not count:
            continue
        for k, v in cost.prefill_layer(m, layout, rates, length, batch, imbalance,
                                       sparse).items():
            prefill[k] = prefill.get(k, 0.0) + count * v
    prefill["host"] = cost.prefill_fixed_s(rates, batch * length)
    decode = {k: m.layers * v for k, v in
              cost.decode_layer(m, layout, rates, batch, length).items()}
    decode["lm_head_read"] = cost.lm_head_read_s(m, rates)
    weights = cost.weight_bytes(m, layout)
    kv_token = cost.kv_bytes_per_token(m, layout)
    slots = max(0, int((rates.gpu_memory_bytes * mem_fraction - weights) // kv_token))
    act = cost.prefill_activation_bytes(m, layout, batch * length, imbalance)
    prefill_s, decode_s = sum(prefill.values()), sum(decode.values())
    return {
        "layout": layout_name(layout),
        "sizes": {k: v for k, v in layout.summary().items() if k != "groups"},
        "weights_gib_per_rank": weights / GIB,
        "kv_bytes_per_token_per_rank": kv_token,
        "kv_slots_per_rank": slots,
        "kv_capacity_prompt_tokens": slots * layout.attn_cp_size,
        "prefill_transient_gib_per_rank": act / GIB,
        "fits_decode": slots * layout.attn_cp_size >= batch * length,
        "fits_prefill": weights + act <= rates.gpu_memory_bytes
                        and slots * layout.attn_cp_size >= batch * length,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": batch * length / prefill_s,
        "prefill_terms_s": prefill,
        "prefill_bottleneck": max(prefill, key=prefill.__getitem__),
        "decode_step_s": decode_s,
        "decode_terms_s": decode,
        "decode_bottleneck": max(decode, key=decode.__getitem__),
    }


def rank(estimates: list[dict], by_decode: bool = False) -> list[dict]:
    key, fits = ("decode_step_s", "fits_decode") if by_decode else ("prefill_s", "fits_prefill")
    return sorted(estimates, key=lambda e: (not e[fits], e[key]))


def text(ranked: list[dict], header: str, by_decode: bool = False) -> str:
    fits = "fits_decode" if by_decode else "fits_prefill"
    lines = [header,
             f"{'#':>2} {'layout':<38} {'weights':>8} {'KV tokens':>10} {'fits':>4} "
             f"{'prefill s':>9} {'tok/s':>8} {'prefill bound':<13} {'decode ms':>9} "
             f"{'decode bound':<12}"]
    for i, e in enumerate(ranked, 1):
        lines.append(f"{i:>2} {e['layout']:<38} {e['weights_gib_per_rank']:>6.1f}Gi "
                     f"{e['kv_capacity_prompt_tokens']:>10,} {'yes' if e[fits] else 'no':>4} "
                     f"{e['prefill_s']:>9.3f} {e['prefill_tokens_per_s']:>8,.0f} "
                     f"{e['prefill_bottleneck']:<13} {e['decode_step_s'] * 1e3:>9.2f} "
                     f"{e['decode_bottleneck']:<12}")
    lines.append("weights: bf16 GiB per rank; KV tokens: prompt tokens the layout's KV cache "
                 "holds (all CP ranks); fits: the prompts within the KV cache and, ranked by "
                 "prefill, weights + prefill transients within the GPU; bound: the largest term")
    return "\n".join(lines)
