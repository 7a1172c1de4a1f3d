"""The parallel layout of one model replica: sizes, validation, rank coordinates, groups.

A `ParallelLayout` is pure: it is built from SGLang-compatible flags and never touches
torch.distributed, so every layout can be validated and inspected without processes.

Sizes (tp = ranks of one replica):
    attn_tp = tp / attn_cp               attention heads are sharded over attn_tp
    moe_tp  = tp / (ep * moe_dp)         each expert's intermediate dim is sharded over moe_tp

Rank coordinates (r in [0, tp)):
    attn_tp_rank = r % attn_tp           attn_cp_rank = r // attn_tp
    moe_tp_rank  = r % moe_tp            moe_ep_rank  = (r // moe_tp) % ep
    moe_dp_rank  = r // (ep * moe_tp)

Group members follow from the coordinates: ranks that differ only in one coordinate form a
group of that kind. MOE_DP is the ATTN_CP group itself when attn_cp > moe_dp (the decoupled
mode): "gather over MoE-DP" then means "gather the CP chunks". The MoE group (`moe`) is the
set of ranks holding one full copy of the experts between them (ep * moe_tp ranks).

EP and MoE-TP combine as in SGLang: with moe_dp > 1 and ep > 1, ep * moe_dp must equal tp;
with moe_dp == 1 any ep dividing tp is allowed and moe_tp = tp / ep (tp 4, ep 2 -> moe_tp 2).
The MOE_EP and MOE_TP groups of one MoE group tile it (each rank is one (ep, tp) cell), so a
rank's expert output is a partial sum over the MoE group and backend `none` needs exactly
one reduction over it, never one over EP followed by one over MoE-TP (SGLang's
`can_merge_post_experts_all_reduce`). Rank-local dispatch backends move tokens to whole
experts, so they keep requiring ep == tp.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("none", "alltoall", "alltoall_padded", "deepep", "mori")
RANK_LOCAL_BACKENDS = ("alltoall", "alltoall_padded", "deepep", "mori")
CP_STRATEGIES = ("zigzag", "interleave")
GROUP_KINDS = ("attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp", "moe")


class LayoutError(ValueError):
    """An invalid layout; the message is one line naming the flags and values."""


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    attn_cp_size: int = 1
    moe_dp_size: int = 1
    ep_size: int = 1
    moe_a2a_backend: str = "none"
    cp_strategy: str = "zigzag"

    def __post_init__(self) -> None:
        self._validate()

    # ---- sizes -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.attn_cp_size

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // (self.ep_size * self.moe_dp_size)

    @property
    def moe_group_size(self) -> int:
        return self.ep_size * self.moe_tp_size

    @property
    def decoupled(self) -> bool:
        """MoE data parallelism narrower than attention CP: MoE tokens gathered over CP."""
        return self.attn_cp_size > self.moe_dp_size

    @property
    def rank_local_dispatch(self) -> bool:
        return self.moe_a2a_backend in RANK_LOCAL_BACKENDS

    # ---- validation --------------------------------------------------------------------
    def _validate(self) -> None:
        tp, cp, dp, ep = self.tp_size, self.attn_cp_size, self.moe_dp_size, self.ep_size
        for flag, value in (("--tp-size", tp), ("--attn-cp-size", cp),
                            ("--moe-dp-size", dp), ("--ep-size", ep)):
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{flag} must be a positive integer, got {value!r}")
        if self.moe_a2a_backend not in BACKENDS:
            raise LayoutError(f"--moe-a2a-backend must be one of {', '.join(BACKENDS)}, "
                              f"got {self.moe_a2a_backend!r}")
        if self.cp_strategy not in CP_STRATEGIES:
            raise LayoutError(f"--cp-strategy must be one of {', '.join(CP_STRATEGIES)}, "
                              f"got {self.cp_strategy!r}")
        if tp % cp:
            raise LayoutError(f"--tp-size {tp} must be divisible by --attn-cp-size {cp}")
        if tp % dp:
            raise LayoutError(f"--tp-size {tp} must be divisible by --moe-dp-size {dp}")
        if dp not in (1, cp):
            raise LayoutError(f"--moe-dp-size {dp} must be 1 (decoupled) or equal to "
                              f"--attn-cp-size {cp} (coupled)")
        if ep * dp > tp:
            raise LayoutError(f"--ep-size {ep} x --moe-dp-size {dp} = {ep * dp} exceeds "
                              f"--tp-size {tp}")
        # SGLang checks ep * moe_dp == tp only when moe_dp > 1; with moe_dp 1, EP and MoE-TP
        # combine (moe_tp = tp / ep) and tile the TP group.
        if dp > 1 and ep > 1 and ep * dp != tp:
            raise LayoutError(f"--ep-size {ep} x --moe-dp-size {dp} must equal --tp-size {tp} "
                              f"when both --ep-size and --moe-dp-size are > 1")
        if tp % ep:
            raise LayoutError(f"--ep-size {ep} must divide --tp-size {tp} (MoE TP size = "
                              f"--tp-size / --ep-size)")
        if self.rank_local_dispatch and ep != tp:
            raise LayoutError(f"--moe-a2a-backend {self.moe_a2a_backend} dispatches rank-locally "
                              f"and needs --ep-size equal to --tp-size {tp}, got --ep-size {ep} "
                              f"(its experts split over MoE TP size {self.moe_tp_size}, which "
                              f"only --moe-a2a-backend none runs)")

    def check_model(self, *, num_experts: int, num_attention_heads: int,
                    num_key_value_heads: int, moe_intermediate_size: int,
                    intermediate_size: int = 0, dense_layers: tuple[int, ...] = ()) -> None:
        """Model-fit rules; KV heads fewer than attn_tp are replicated, so they must divide it;
        dense MLP layers (`dense_layers`, of width intermediate_size) shard over attn_tp."""
        if num_experts and num_experts % self.ep_size:
            raise LayoutError(f"--ep-size {self.ep_size} must divide the model's "
                              f"num_experts {num_experts}")
        if num_attention_heads % self.attn_tp_size:
            raise LayoutError(f"attention TP size {self.attn_tp_size} (--tp-size {self.tp_size} "
                              f"/ --attn-cp-size {self.attn_cp_size}) must divide the model's "
                              f"num_attention_heads {num_attention_heads}")
        kv, atp = num_key_value_heads, self.attn_tp_size
        if (kv >= atp and kv % atp) or (kv < atp and atp % kv):
            raise LayoutError(f"attention TP size {atp} and the model's num_key_value_heads {kv} "
                              f"must divide one another")
        if num_experts and moe_intermediate_size % self.moe_tp_size:
            raise LayoutError(f"MoE TP size {self.moe_tp_size} (--tp-size {self.tp_size} / "
                              f"(--ep-size {self.ep_size} x --moe-dp-size {self.moe_dp_size})) "
                              f"must divide the model's moe_intermediate_size "
                              f"{moe_intermediate_size}")
        if dense_layers and intermediate_size % self.attn_tp_size:
            raise LayoutError(f"attention TP size {self.attn_tp_size} must divide the model's "
                              f"intermediate_size {intermediate_size} (dense layers "
                              f"{list(dense_layers)})")

    # ---- coordinates -------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside [0, {self.tp_size})")
        return {
            "attn_tp": rank % self.attn_tp_size,
            "attn_cp": rank // self.attn_tp_size,
            "moe_tp": rank % self.moe_tp_size,
            "moe_ep": (rank // self.moe_tp_size) % self.ep_size,
            "moe_dp": rank // self.moe_group_size,
            "moe": rank % self.moe_group_size,
        }

    def group_members(self, kind: str) -> list[list[int]]:
        """Sorted member lists of every group of one kind; each rank is in exactly one."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")
        if kind == "moe_dp" and self.decoupled:
            return self.group_members("attn_cp")
        # Ranks share a group of `kind` when every *other* coordinate that distinguishes
        # replicas of this kind is equal; the key below names those coordinates.
        keys = {
            "attn_tp": lambda c: (c["attn_cp"],),
            "attn_cp": lambda c: (c["attn_tp"],),
            "moe_tp": lambda c: (c["moe_dp"], c["moe_ep"]),
            "moe_ep": lambda c: (c["moe_dp"], c["moe_tp"]),
            "moe_dp": lambda c: (c["moe"],),
            "moe": lambda c: (c["moe_dp"],),
        }[kind]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.tp_size):
            groups.setdefault(keys(self.coords(r)), []).append(r)
        return sorted(groups.values())

    def group_of(self, kind: str, rank: int) -> list[int]:
        return next(g for g in self.group_members(kind) if rank in g)

    def summary(self) -> dict:
        return {
            "world_size": self.world_size,
            "attn_tp_size": self.attn_tp_size,
            "attn_cp_size": self.attn_cp_size,
            "moe_ep_size": self.ep_size,
            "moe_tp_size": self.moe_tp_size,
            "moe_dp_size": self.moe_dp_size,
            "moe_a2a_backend": self.moe_a2a_backend,
            "cp_strategy": self.cp_strategy,
            "groups": {k: self.group_members(k) for k in GROUP_KINDS},
        }
