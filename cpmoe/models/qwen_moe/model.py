"""Qwen3-MoE and Qwen2-MoE, one rank's shard, with HF parameter names.

Attention heads are sharded over attention TP; each CP rank holds its chunk of the tokens.
Routed experts are sharded over EP (whole experts) and MoE-TP (intermediate dim). The
Qwen2-MoE shared expert (sigmoid-gated) and the router are replicated and run on CP-local
rows, so the shared expert is added once, after every reduction. Dense MLP layers
(`mlp_only_layers`, `decoder_sparse_step`) are sharded over attention TP.
Every token movement goes through the communicator; this file makes no collective call.

Legend: T = tokens of this rank (its CP chunk), H = hidden, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe import communicator
from cpmoe.cp.attention import chunk_attention_with_lse, fp8_runs_apply, prefill_attention
from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.cp.paged_attention import paged_decode_attention
from cpmoe.linear import Linear, column_shard, fuse_linears, kv_head_shard, row_shard
from cpmoe.models.base import CausalLMHead
from cpmoe.models.layers import RMSNorm, RotaryEmbedding, default_inv_freq
from cpmoe.models.qwen_moe.config import QwenMoeConfig
from cpmoe.moe.dispatch import create_dispatcher
from cpmoe.moe.experts import LocalExperts
from cpmoe.moe.placement import ExpertPlacement
from cpmoe.moe.router import SoftmaxTopKRouter
from cpmoe.ops import (merge_two_attention, norm_rope, norm_rope_fp8, qkv_norm_rope_store,
                       qkv_norm_rope_store_fp8)
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.quant.modules import fp8_input_group


class QwenMoeAttention(nn.Module):
    def __init__(self, cfg: QwenMoeConfig, groups: ProcessGroups, dtype: torch.dtype) -> None:
        super().__init__()
        tp, r = groups.attn_tp.size, groups.attn_tp.rank
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads, kv_shard = kv_head_shard(cfg.num_key_value_heads, r, tp)
        self.head_dim, self.scale = D, D ** -0.5
        self.groups = groups
        bias = cfg.qkv_bias
        self.q_proj = Linear(H, self.num_heads * D, bias=bias, dtype=dtype,
                             shard=column_shard(r, tp))
        self.k_proj = Linear(H, self.num_kv_heads * D, bias=bias, dtype=dtype, shard=kv_shard)
        self.v_proj = Linear(H, self.num_kv_heads * D, bias=bias, dtype=dtype, shard=kv_shard)
        self.o_proj = Linear(self.num_heads * D, H, bias=False, dtype=dtype,
                             shard=row_shard(r, tp))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        # FP8 pools' per-layer K/V scales (k_scale, v_scale, 1/k_scale, 1/v_scale; all 1
        # unless the checkpoint has self_attn.k_scale / v_scale: `quant.kv_scales`)
        self.register_buffer("kv_scale", torch.ones(4, dtype=torch.float32), persistent=False)
        self.qkv: Callable[[torch.Tensor], torch.Tensor] | None = None  # see fuse_qkv
        # an FP8 o_proj's: decode attention quantizes o, FP8 prefill attention offers its
        # e4m3 O (`prefill_attention`)
        self.o_quant_group: int | None = None

    def fuse_qkv(self) -> None:
        """One GEMM for q, k and v (their weights become views into the fused one)."""
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x_TH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, layer: int) -> torch.Tensor:
        """-> o_proj output, a partial sum over attention TP."""
        T, D = x_TH.shape[0], self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x_TH)
        else:
            qkv = torch.cat([self.q_proj(x_TH), self.k_proj(x_TH), self.v_proj(x_TH)], dim=-1)
        # FP8 prefill attention of a normed q and no cached prefix: q is written in e4m3 by
        # its norm + RoPE kernel, at a scale its norm's weight bounds (`ops.norm_rope_fp8`)
        fp8_q = (not batch.is_decode and self.q_norm is not None and batch.prefix is None
                 and fp8_runs_apply(qkv, batch.q_runs, batch.fp8_attention))
        if batch.is_decode:
            o = self._decode(qkv, rope, batch, layer)
        elif batch.kv is not None and batch.write_slots is not None:
            # q/k norm + RoPE and the K/V writes in one kernel (as decode), K/V read back
            q, q_descale = self._store(qkv, rope, batch, layer, fp8_q)
            o = self._extend(q, *batch.kv.read(layer, batch.write_slots, qkv.dtype,
                                               self.kv_scale), batch, layer, q_descale)
        else:
            q, k, v = qkv.split([self.num_heads * D, self.num_kv_heads * D,
                                 self.num_kv_heads * D], dim=-1)
            q, k = q.view(T, self.num_heads, D), k.view(T, self.num_kv_heads, D)
            v = v.reshape(T, self.num_kv_heads, D)  # FP8 attention quantizes it where it lies
            q_descale = k_descale = None
            if fp8_q:
                q, q_descale = norm_rope_fp8(q, self.q_norm.weight, self.q_norm.eps, *rope)
                if self.groups.attn_cp.size == 1:  # k likewise (over CP it is all-gathered
                    # with v in one 16-bit tensor): no amax and cast passes over it
                    k, k_descale = norm_rope_fp8(k, self.k_norm.weight, self.k_norm.eps,
                                                 *rope)
                else:
                    k = norm_rope(k, self.k_norm.weight, self.k_norm.eps, *rope)
            elif self.q_norm is not None:  # per-head RMSNorm, fused with the rotary embedding
                q = norm_rope(q, self.q_norm.weight, self.q_norm.eps, *rope)
                k = norm_rope(k, self.k_norm.weight, self.k_norm.eps, *rope)
            else:
                q, k = norm_rope(q, None, 0.0, *rope), norm_rope(k, None, 0.0, *rope)
            o = self._extend(q, k, v if fp8_q else v.contiguous(), batch, layer, q_descale,
                             k_descale)
        return self.o_proj(o.reshape(T, self.num_heads * D))

    def _store(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               batch: ForwardBatch, layer: int, fp8_q: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q/k norm + RoPE with the new k/v written to `batch.write_slots` -> (q, None), or
        with fp8_q (e4m3 q, `ops.qkv_norm_rope_store_fp8`) (q, its descale); one kernel on
        the GPU: `ops.qkv_norm_rope_store`, the same q/k math as `ops.norm_rope`."""
        kv = batch.kv
        norms = (None, None, 0.0) if self.q_norm is None else (
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        args = (qkv, self.num_heads, self.num_kv_heads, *norms, *rope, kv.k[layer],
                kv.v[layer], batch.write_slots, self.kv_scale)
        if fp8_q:
            return qkv_norm_rope_store_fp8(*args)
        return qkv_norm_rope_store(*args), None

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                layer: int, q_descale: torch.Tensor | None = None,
                k_descale: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's chunk rows attend their own sequence's new tokens (K/V gathered over
        CP) causally and, for sequences with cached tokens, the cached prefix. q_descale,
        k_descale: q, k in e4m3 (`ops.norm_rope_fp8`; no cached prefix)."""
        kv = batch.kv
        assert batch.split is not None
        k_flat, v_flat = communicator.gather_kv(k, v, batch, self.groups)
        cu = list(batch.split.cu_seqlens)
        if batch.prefix is None:
            # FP8 attention may leave o in e4m3 for an FP8 o_proj (offered, o unwritten)
            return prefill_attention(q, batch.rel_positions, batch.token_to_seq, k_flat, v_flat,
                                     cu, self.scale, batch.q_runs, batch.packed_runs,
                                     batch.fp8_attention, self.o_quant_group, q_descale,
                                     k_descale)
        fp8 = fp8_runs_apply(q, batch.q_runs, batch.fp8_attention)  # the chunk and prefix
        o, lse = chunk_attention_with_lse(q, batch.rel_positions, batch.token_to_seq, k_flat,
                                          v_flat, cu, self.scale, batch.packed_runs,
                                          batch.q_runs, fp8)
        o_pre, lse_pre = communicator.attend_cached_prefix(q, batch, self.groups, kv.k[layer],
                                                           kv.v[layer], self.scale,
                                                           self.kv_scale, fp8)
        return merge_two_attention(o, lse, o_pre, lse_pre, torch.empty_like(q))

    def _decode(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, layer: int) -> torch.Tensor:
        """q/k norm + RoPE with the new k/v written to this rank's pages (one kernel on the
        GPU), then every row attends its sequence's pages, merged over the CP ranks."""
        kv = batch.kv
        assert kv is not None and batch.block_table is not None and batch.kv_lens is not None
        q, _ = self._store(qkv, rope, batch, layer)
        cp = self.groups.attn_cp.size
        o, lse = paged_decode_attention(q, kv.k[layer], kv.v[layer], batch.block_table,
                                        batch.kv_lens, self.scale,
                                        out_dtype=torch.float32 if cp > 1 else q.dtype,
                                        quant_group=self.o_quant_group if cp == 1 else None,
                                        kv_scale=self.kv_scale)
        return communicator.merge_decode_attention(o, lse, self.groups).to(q.dtype)


class QwenMoeMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        I = intermediate // tp_size
        self.gate_proj = Linear(hidden, I, bias=False, dtype=dtype,
                                shard=column_shard(tp_rank, tp_size))
        self.up_proj = Linear(hidden, I, bias=False, dtype=dtype,
                              shard=column_shard(tp_rank, tp_size))
        self.down_proj = Linear(I, hidden, bias=False, dtype=dtype,
                                shard=row_shard(tp_rank, tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenMoeSparseBlock(nn.Module):
    def __init__(self, cfg: QwenMoeConfig, groups: ProcessGroups, backend: str,
                 dtype: torch.dtype) -> None:
        super().__init__()
        layout = groups.layout
        H = cfg.hidden_size
        self.gate = SoftmaxTopKRouter(H, cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.norm_topk_prob, dtype)
        self.experts = LocalExperts(cfg.num_experts // layout.ep_size, H,
                                    cfg.moe_intermediate_size // layout.moe_tp_size, dtype,
                                    shard=(groups.moe_ep.rank, layout.ep_size,
                                           groups.moe_tp.rank, layout.moe_tp_size))
        self.placement = ExpertPlacement(cfg.num_experts)
        self.dispatcher = create_dispatcher(backend, groups, cfg.num_experts)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = QwenMoeMLP(H, cfg.shared_expert_intermediate_size, dtype)
            self.shared_expert_gate = Linear(H, 1, bias=False, dtype=dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def routed(self, x_NH: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x_NH)
        ids = self.placement.route(ids)
        recv_x, recv_ids, recv_w, handle = self.dispatcher.dispatch(x_NH, ids, weights)
        return self.dispatcher.combine(self.experts(recv_x, recv_ids, recv_w), handle)

    def shared(self, x_NH: torch.Tensor) -> torch.Tensor | None:
        if self.shared_expert is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x_NH)) * self.shared_expert(x_NH)


class QwenMoeDecoderLayer(nn.Module):
    def __init__(self, cfg: QwenMoeConfig, groups: ProcessGroups, plan: communicator.LayerPlan,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = plan.layer
        self.layer_communicator = communicator.LayerCommunicator(plan, groups)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = QwenMoeAttention(cfg, groups, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if plan.sparse:
            self.mlp = QwenMoeSparseBlock(cfg, groups, groups.layout.moe_a2a_backend, dtype)
        else:
            self.mlp = QwenMoeMLP(cfg.hidden_size, cfg.intermediate_size, dtype,
                                  groups.attn_tp.rank, groups.attn_tp.size)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.layer_communicator.prepare_attn(h, residual, self.input_layernorm)
        attn = self.self_attn(x, rope, batch, self.layer)
        x_mlp, x_local, residual = self.layer_communicator.prepare_mlp(attn, residual,
                                                         self.post_attention_layernorm, batch)
        if isinstance(self.mlp, QwenMoeSparseBlock):
            out = self.layer_communicator.postprocess_layer(
                self.mlp.routed(x_mlp), self.mlp.shared(x_local), batch)
        else:
            out = self.layer_communicator.postprocess_layer(self.mlp(x_mlp), None, batch)
        return out, residual


class QwenMoeModel(nn.Module):
    def __init__(self, cfg: QwenMoeConfig, groups: ProcessGroups, dtype: torch.dtype) -> None:
        super().__init__()
        sparse = [cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)]
        self.plans = communicator.plan_layers(groups.layout, sparse)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(QwenMoeDecoderLayer(cfg, groups, p, dtype)
                                    for p in self.plans)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(default_inv_freq(cfg.rope_theta, cfg.head_dim))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, h.dtype)
        rope = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # rotate-half: [T, D]
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, batch)
        return self.norm.add_forward(h, residual)[0]


class QwenMoeForCausalLM(CausalLMHead):
    def __init__(self, cfg: QwenMoeConfig, groups: ProcessGroups, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.groups = groups
        self.model = QwenMoeModel(cfg, groups, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)

    @staticmethod
    def checkpoint_shapes(cfg: QwenMoeConfig) -> dict[str, tuple[int, ...]]:
        return checkpoint_shapes(cfg)

    def fuse_weights(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            # the kernels before FP8 GEMMs write their FP8 rows too (no quantization launch)
            mlp = layer.mlp
            first = mlp.experts if isinstance(mlp, QwenMoeSparseBlock) else mlp.gate_proj
            layer.input_layernorm.quant_group = fp8_input_group(layer.self_attn.q_proj)
            layer.post_attention_layernorm.quant_group = fp8_input_group(first)
            layer.self_attn.o_quant_group = fp8_input_group(layer.self_attn.o_proj)



def checkpoint_shapes(cfg: QwenMoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name and full shape of a hub checkpoint of this config."""
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H),
                                           "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                   p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q)}
        if cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
        if not cfg.is_sparse_layer(i):
            shapes |= _mlp_shapes(p + "mlp.", H, cfg.intermediate_size)
            continue
        shapes[p + "mlp.gate.weight"] = (cfg.num_experts, H)
        for e in range(cfg.num_experts):
            shapes |= _mlp_shapes(f"{p}mlp.experts.{e}.", H, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            shapes |= _mlp_shapes(p + "mlp.shared_expert.", H,
                                  cfg.shared_expert_intermediate_size)
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden),
            prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}
