"""Token layouts between attention and MLP, and every token movement of the model.

Layouts (SGLang's LayerCommunicator vocabulary):
    SCATTERED     each rank its own rows: the CP chunk split again over attention TP
    TP_ATTN_FULL  all rows of the CP chunk, replicated over the attention-TP group
    FULL          the same rows, full over attention DP (DP is 1, so == TP_ATTN_FULL)
    MOE_FULL      every CP chunk of the MoE group gathered (decoupled MoE, backend none)

Attention always runs in TP_ATTN_FULL. The MLP of a layer runs in:
    dense layer                           TP_ATTN_FULL (sharded over attention TP)
    sparse, rank-local dispatch backend   SCATTERED
    sparse, backend none, attn_cp > moe_dp MOE_FULL
    sparse, backend none, otherwise       FULL
Backend none: each rank's expert output is a partial sum over the MoE group (its EP x MoE-TP
shards tile the group, also when both are > 1), so one reduction over that group completes
it; there is never a reduction over MOE_EP followed by one over MOE_TP.
The plan is computed once per layer. The residual stream always stays CP-local in
TP_ATTN_FULL. Shared-expert outputs are computed on CP-local rows and added after every
SUM collective, so they are counted once. Decode rows are identical on every CP rank, so no
MLP row is computed twice: MOE_FULL skips its gather (its reduction spans every expert shard
once), SCATTERED splits rows over the whole world, FULL and dense layers split them over CP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from cpmoe.cp.attention import merge_with_lse, prefix_partial
from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.ops import merge_partials
from cpmoe.parallel import comm
from cpmoe.parallel.groups import Group, ProcessGroups
from cpmoe.parallel.layout import ParallelLayout


class TokenLayout(enum.Enum):
    SCATTERED = "SCATTERED"
    TP_ATTN_FULL = "TP_ATTN_FULL"
    FULL = "FULL"
    MOE_FULL = "MOE_FULL"


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    sparse: bool
    attn: TokenLayout
    mlp: TokenLayout


def plan_layers(layout: ParallelLayout, sparse: list[bool]) -> list[LayerPlan]:
    def mlp_layout(is_sparse: bool) -> TokenLayout:
        if not is_sparse:
            return TokenLayout.TP_ATTN_FULL
        if layout.rank_local_dispatch:
            return TokenLayout.SCATTERED
        return TokenLayout.MOE_FULL if layout.decoupled else TokenLayout.FULL

    return [LayerPlan(i, s, TokenLayout.TP_ATTN_FULL, mlp_layout(s)) for i, s in enumerate(sparse)]


def _even_rows(n: int, max_n: int, parts: int, index: int) -> tuple[int, int, int]:
    """Contiguous split of this rank's n rows over `parts`, with the chunk sized from the
    largest n any rank of the group has (max_n), so every rank's chunk has the same padded
    size: (start, stop, padded rows per part)."""
    chunk = max(1, -(-max_n // parts))
    start = min(n, index * chunk)
    return start, min(n, start + chunk), chunk


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


class ResidualNorm(Protocol):
    """A norm that also takes the residual add before it (models/layers.RMSNorm)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerCommunicator:
    """The three transitions of one decoder layer."""

    def __init__(self, plan: LayerPlan, groups: ProcessGroups) -> None:
        self.plan = plan
        self.groups = groups

    def prepare_attn(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                     norm: ResidualNorm) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return norm(hidden), hidden
        return norm.add_forward(hidden, residual)

    def prepare_mlp(self, attn_partial: torch.Tensor, residual: torch.Tensor,
                    norm: ResidualNorm,
                    batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (rows for the MLP in its layout, CP-local rows for shared experts, residual)."""
        x, residual = norm.add_forward(comm.all_reduce(attn_partial, self.groups.attn_tp),
                                       residual)
        return self.to_mlp_layout(x, batch), self.local_rows(x, batch), residual

    def to_mlp_layout(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """CP-local TP_ATTN_FULL rows (hidden states, or token ids for hash routing: any
        per-row tensor) -> the rows the MLP of this layer sees, in the same order."""
        mode = self.plan.mlp
        if mode is TokenLayout.MOE_FULL and not batch.is_decode:
            assert batch.split is not None
            return comm.all_gather(batch.split.pad_local(x), self.groups.attn_cp)
        return self.local_rows(x, batch)

    def local_rows(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The rows this rank answers for after the MLP (shared experts run on these)."""
        group = self._split_group(batch)
        if group is None:
            return x
        start, stop, chunk = _even_rows(x.shape[0], self._max_rows(batch), group.size,
                                        group.rank)
        return _pad_rows(x[start:stop], chunk)  # same row count on every rank

    def postprocess_layer(self, mlp_out: torch.Tensor, shared_out: torch.Tensor | None,
                          batch: ForwardBatch) -> torch.Tensor:
        """MLP output (partial, or final for own rows) -> this CP rank's rows, TP_ATTN_FULL."""
        mode, moe, cp = self.plan.mlp, self.groups.moe, self.groups.attn_cp
        if mode is TokenLayout.TP_ATTN_FULL:
            out = comm.all_reduce(mlp_out, self.groups.attn_tp)
        elif mode is TokenLayout.SCATTERED:
            out = mlp_out
        elif mode is TokenLayout.MOE_FULL and not batch.is_decode and moe.ranks == cp.ranks:
            # the expert shards are exactly the CP ranks: each keeps its own chunk's sum
            out = comm.reduce_scatter(mlp_out, cp)[:batch.num_tokens]
        else:
            out = comm.all_reduce(mlp_out, moe)
            if mode is TokenLayout.MOE_FULL and not batch.is_decode:
                assert batch.split is not None
                start = cp.rank * batch.split.max_count
                out = out[start:start + batch.num_tokens]
        if shared_out is not None:
            out = out + shared_out
        group = self._split_group(batch)
        if group is None:
            return out
        return comm.all_gather(out, group)[:batch.num_tokens]

    @staticmethod
    def _max_rows(batch: ForwardBatch) -> int:
        """Rows of the rank with the most (decode rows are the same everywhere)."""
        return batch.split.max_count if batch.split is not None else batch.num_tokens

    def _split_group(self, batch: ForwardBatch) -> Group | None:
        """The group whose ranks share this layer's MLP rows out between them, or None.

        Prefill: SCATTERED splits the CP chunk over attention TP. Decode rows are the same
        on every rank: SCATTERED splits them over the whole world, and FULL / dense layers
        split them over attention CP so no CP rank recomputes another's rows (MOE_FULL
        needs no split: its reduction already spans every expert shard exactly once)."""
        mode = self.plan.mlp
        if mode is TokenLayout.SCATTERED:
            return self.groups.world if batch.is_decode else self.groups.attn_tp
        if batch.is_decode and mode is not TokenLayout.MOE_FULL and self.groups.attn_cp.size > 1:
            return self.groups.attn_cp
        return None


# ---- attention-side CP movement (model-wide, not per layer) -------------------------------

def gather_kv(k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, groups: ProcessGroups
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: every sequence's K/V in flat (original) order, from one all-gather over
    ATTN_CP that carries K and V together. Synchronous on purpose: overlapping it with the
    attention to each run's own keys measured slower in the whole model on 2 H200s (one
    rank's attention ran ~20% longer; the cause is not pinned down, BENCHMARKS.md)."""
    if groups.attn_cp.size == 1:
        return k, v
    assert batch.split is not None
    kv = torch.stack([batch.split.pad_local(k), batch.split.pad_local(v)], dim=1)
    kv = batch.split.unpermute(comm.all_gather(kv, groups.attn_cp))  # [sum L, 2, Hkv, D]
    return kv[:, 0], kv[:, 1]


def attend_cached_prefix(q: torch.Tensor, batch: ForwardBatch, groups: ProcessGroups,
                         k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
                         kv_scale: torch.Tensor | None = None, fp8: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend: this rank's queries [T, H, D] against their sequences' cached prefixes, whose
    K/V stays sharded over the CP ranks -> (o [T, H, D], lse [T, H]) fp32 (at CP 1 o as
    `prefix_partial` leaves it: q's dtype on CUDA), exact over the whole prefix. The queries
    are all-gathered over ATTN_CP, every rank attends all of them to its own shard, and one
    all-to-all returns each rank's partial results for its own rows, merged by log-sum-exp
    (no rank ever holds another's prefix K/V). kv_scale: the layer's K/V scales of FP8
    pools; fp8: this rank attends its shard in FP8 (`prefix_partial`)."""
    cp = groups.attn_cp
    assert batch.prefix is not None and batch.split is not None
    q_all = q if cp.size == 1 else comm.all_gather(batch.split.pad_local(q), cp)
    o, lse = prefix_partial(q_all, batch.prefix, k_pool, v_pool, scale, kv_scale, fp8)
    if cp.size == 1:
        return o, lse
    R, H, D = o.shape
    rows = batch.split.max_count
    back = comm.all_to_all(torch.cat([o.reshape(R, H * D).float(), lse], dim=1),
                           [rows] * cp.size, [rows] * cp.size, cp).view(cp.size, rows, H * D + H)
    o, lse = merge_with_lse(back[..., :H * D].reshape(cp.size, rows, H, D), back[..., H * D:])
    return o[:batch.num_tokens], lse[:batch.num_tokens]


def merge_decode_attention(o: torch.Tensor, lse: torch.Tensor,
                           groups: ProcessGroups) -> torch.Tensor:
    """Each CP rank's partial attention over its KV shard -> the exact result, fp32."""
    if groups.attn_cp.size == 1:
        return o
    T, H, D = o.shape
    packed = torch.cat([o.reshape(T, H * D), lse], dim=1)
    parts = comm.all_gather(packed, groups.attn_cp).reshape(groups.attn_cp.size, T, H * D + H)
    return merge_partials(parts[..., :H * D].reshape(-1, T, H, D), parts[..., H * D:])


def gather_output(hidden: torch.Tensor, batch: ForwardBatch,
                  groups: ProcessGroups) -> torch.Tensor:
    """Rows of this CP rank (final hidden states, or any per-token tensor) -> every token of
    the batch in flat (original) order, on every rank."""
    if batch.is_decode or groups.attn_cp.size == 1:
        return hidden
    assert batch.split is not None
    return batch.split.unpermute(comm.all_gather(batch.split.pad_local(hidden),
                                                 groups.attn_cp))
