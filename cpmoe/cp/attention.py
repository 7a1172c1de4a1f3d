"""Attention math for CP prefill and sharded-KV decode (no communication here).

- `prefill_attention`: this rank's queries (its CP chunk, any order within a sequence)
  against the full K/V of their sequences in original order, causal on global positions.
- `partial_attention`: queries against one KV shard, returning output and log-sum-exp
  (natural log, fp32) so shards can be merged; a query that sees no key gets lse = -inf.
- `merge_partials`: o = sum_i exp(lse_i - lse) * o_i with lse = logsumexp_i(lse_i), in fp32;
  fully masked shards weigh zero.

Legend: T = local query tokens, N = keys, H = local query heads, Hkv = local KV heads,
D = head dim. GQA: query head h reads KV head h // (H / Hkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows of queries processed at once: bounds the [H, rows, keys] mask/score memory.
_QUERY_CHUNK = 1024


def prefill_attention(q: torch.Tensor, q_pos: torch.Tensor, q_seq: torch.Tensor,
                      k_flat: torch.Tensor, v_flat: torch.Tensor, cu_seqlens: list[int],
                      scale: float) -> torch.Tensor:
    """q [T, H, D] with positions/sequence ids [T]; k/v_flat [sum L, Hkv, D] flat order."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_flat.shape[1]
    for s in range(len(cu_seqlens) - 1):
        rows = (q_seq == s).nonzero().flatten()
        if rows.numel() == 0:
            continue
        k = k_flat[cu_seqlens[s]:cu_seqlens[s + 1]].transpose(0, 1)  # [Hkv, L, D]
        v = v_flat[cu_seqlens[s]:cu_seqlens[s + 1]].transpose(0, 1)
        for start in range(0, rows.numel(), _QUERY_CHUNK):
            r = rows[start:start + _QUERY_CHUNK]
            pos = q_pos[r]
            n_keys = int(pos.max()) + 1  # keys past the last query position are all masked
            mask = torch.arange(n_keys, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(
                q[r].transpose(0, 1), k[:, :n_keys], v[:, :n_keys], attn_mask=mask,
                scale=scale, enable_gqa=gqa)
            out[r] = o.transpose(0, 1)
    return out


def partial_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] against one shard k/v [N, Hkv, D] -> o [T, H, D] (fp32), lse [T, H] (fp32)."""
    T, H, D = q.shape
    if k.shape[0] == 0:
        return (torch.zeros(T, H, D, dtype=torch.float32, device=q.device),
                torch.full((T, H), float("-inf"), device=q.device))
    group = H // k.shape[1]
    qf = q.float().reshape(T, k.shape[1], group, D)
    scores = torch.einsum("tkgd,nkd->tkgn", qf, k.float()) * scale
    visible = (k_pos[None, :] <= q_pos[:, None])[:, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, Hkv, G]
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    o = torch.einsum("tkgn,nkd->tkgd", probs, v.float())
    return o.reshape(T, H, D), lse.reshape(T, H)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [P, T, H, D] and lse [P, T, H] of P shards -> merged o [T, H, D] (fp32)."""
    total = torch.logsumexp(lse, dim=0)  # [T, H]
    weight = torch.exp(lse - total.nan_to_num(neginf=0.0)[None])  # -inf shards -> 0
    return (weight[..., None] * o.float()).sum(dim=0)
