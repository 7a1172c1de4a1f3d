"""DeepSeek-V4 (DeepseekV4ForCausalLM), one rank's shard, with HF parameter names.

Top to bottom: MoE (router, experts, shared expert), hyper-connections, decoder layer, model,
causal-LM head; attention lives in `attention.py`, its two paths in `prefill.py` and
`decode.py`, which the decoder layer picks between.

Parallelism (layouts checked by `check_v4_layout`: attn_cp == tp):
- Attention is not head-sharded. Each CP rank holds its chunk of the tokens; the K-side
  per-token rows are all-gathered over ATTN_CP once per layer and the compressed KV and
  indexer keys are pooled on every rank (replicated), see the attention module.
- Replicated weights: everything except the routed experts (attention, compressors,
  indexers, hyper-connections, routers, shared experts, embeddings, head).
- Routed experts are sharded over EP (whole experts) and MoE-TP (intermediate dim). Hidden
  rows AND token ids (hash-routed layers) move to the MLP layout through the same
  communicator call, so ids stay aligned with rows (rank-major after a CP gather, own rows
  for rank-local dispatch). The shared expert runs on CP-local rows and is added after every
  SUM collective, so once.
- Decode: each CP rank keeps its share of every sequence's compressed KV and indexer keys
  (round-robin by entry; the sliding window and open-window rows replicated), attends its
  share for every row and merges by LSE over ATTN_CP (`decode.py`,
  `config.DECODE_CACHE_NOTE`); the MoE stays distributed.

The residual stream is `hc_mult` streams per token, [T, hc, H], mixed by manifold-
constrained hyper-connections (Sinkhorn-projected doubly-stochastic mixing) around both
blocks; the hyper head collapses them before the final norm. On CUDA in 16 bits their stream
arithmetic (merge, collapse, the mix with its RMS) runs as Triton kernels
(`hyper_connection.py`);
float32 and CPU keep the torch expressions. Multi-token prediction is not built.
Legend: T = tokens of this rank, H = hidden, E = experts, K = top-k, hc = streams.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpmoe import communicator
from cpmoe.cp.forward_batch import ForwardBatch
from cpmoe.linear import Linear, param
from cpmoe.models.deepseek_v4.attention import DeepseekV4Attention, Rope, rope_inv_freq
from cpmoe.models.deepseek_v4.cache import V4Cache, cache_summary, tokens_for_bytes
from cpmoe.models.deepseek_v4.config import HASH_MOE, DeepseekV4Config
from cpmoe.models.deepseek_v4.decode import decode_attention
from cpmoe.models.deepseek_v4.graph import V4DecodeGraphs
from cpmoe.models.deepseek_v4.hyper_connection import hc_collapse, hc_merge, hc_mix, hc_weights
from cpmoe.models.deepseek_v4.prefill import PrefillPlan, prefill_attention
from cpmoe.models.deepseek_v4.sparse import kernel_applies
from cpmoe.models.deepseek_v4.state import DecodeStep
from cpmoe.models.base import CausalLMHead
from cpmoe.models.layers import RMSNorm, RotaryEmbedding
from cpmoe.models.random_weights import one_rank_checkpoint_shapes
from cpmoe.moe.dispatch import create_dispatcher
from cpmoe.moe.experts import LocalExperts
from cpmoe.moe.placement import ExpertPlacement
from cpmoe.ops import clamped_swiglu
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.layout import ParallelLayout

# Checkpoint names (what transformers' save_pretrained writes: the original DeepSeek names
# under `model.`) -> HF parameter names; applied in order, each at most once per name.
CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^head\.", "lm_head."),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.ape$", ".position_bias"),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.w1\.weight$", ".gate_proj.weight"),
    (r"\.w2\.weight$", ".down_proj.weight"),
    (r"\.w3\.weight$", ".up_proj.weight"),
)
_RENAMES = tuple((re.compile(p), r) for p, r in CHECKPOINT_RENAMES)


def checkpoint_param_name(name: str) -> str:
    """A checkpoint tensor name -> the HF parameter name it fills (per-expert tensors become
    `...mlp.experts.<e>.<gate|up|down>_proj.weight`, which the loader fuses)."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name, count=1)
    return name


# ---- MoE -------------------------------------------------------------------------------------

class DeepseekV4Router(nn.Module):
    """Scores = sqrtsoftplus (or sigmoid) of the expert logits. Top-k layers select by
    scores + e_score_correction_bias; hash layers take `tid2eid[token id]`. Weights are the
    unbiased scores of the selection, renormalised, times routed_scaling_factor."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        self.top_k, self.hashed, self.scoring = k, hashed, cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.weight = param(E, cfg.hidden_size, dtype=dtype)
        if hashed:
            self.tid2eid = param(cfg.vocab_size, k, dtype=torch.int64)
        else:
            self.e_score_correction_bias = param(E, dtype=torch.float32)

    def forward(self, x_NH: torch.Tensor, ids_N: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (topk_ids_NK int64, topk_weights_NK in x's dtype); ids_N only for hash layers."""
        logits = F.linear(x_NH, self.weight)
        scores = (F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus"
                  else torch.sigmoid(logits))
        if self.hashed:
            assert ids_N is not None
            topk = self.tid2eid[ids_N]
        else:
            topk = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1,
                              sorted=False).indices
        weights = scores.gather(1, topk)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk, weights * self.scaling


class DeepseekV4Experts(LocalExperts):
    """LocalExperts with V4's clamped SwiGLU (gate <= limit, |up| <= limit)."""

    def __init__(self, *args, swiglu_limit: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.swiglu_limit = swiglu_limit


class DeepseekV4MLP(nn.Module):
    """The shared expert (replicated), clamped SwiGLU."""

    def __init__(self, hidden: int, intermediate: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class DeepseekV4SparseMoeBlock(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, groups: ProcessGroups,
                 dtype: torch.dtype) -> None:
        super().__init__()
        layout = groups.layout
        H = cfg.hidden_size
        self.hashed = cfg.mlp_layer_types[layer] == HASH_MOE
        self.gate = DeepseekV4Router(cfg, self.hashed, dtype)
        self.experts = DeepseekV4Experts(
            cfg.num_experts // layout.ep_size, H, cfg.moe_intermediate_size // layout.moe_tp_size,
            dtype, shard=(groups.moe_ep.rank, layout.ep_size, groups.moe_tp.rank,
                          layout.moe_tp_size), swiglu_limit=cfg.swiglu_limit)
        self.shared_experts = DeepseekV4MLP(H, cfg.moe_intermediate_size, cfg.swiglu_limit, dtype)
        self.placement = ExpertPlacement(cfg.num_experts)
        self.dispatcher = create_dispatcher(layout.moe_a2a_backend, groups, cfg.num_experts)

    def forward(self, x_TH: torch.Tensor,
                layer_communicator: communicator.LayerCommunicator, batch: ForwardBatch
                ) -> torch.Tensor:
        """CP-local rows in -> CP-local rows out (routed + shared, each counted once)."""
        x = layer_communicator.to_mlp_layout(x_TH, batch)
        ids = layer_communicator.to_mlp_layout(batch.input_ids, batch) if self.hashed else None
        topk_ids, topk_w = self.gate(x, ids)
        topk_ids = self.placement.route(topk_ids)
        recv_x, recv_ids, recv_w, handle = self.dispatcher.dispatch(x, topk_ids, topk_w)
        routed = self.dispatcher.combine(self.experts(recv_x, recv_ids, recv_w), handle)
        shared = self.shared_experts(layer_communicator.local_rows(x_TH, batch))
        return layer_communicator.postprocess_layer(routed, shared, batch)


# ---- hyper-connections -----------------------------------------------------------------------

def _flat_rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    flat = h.flatten(1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def _mix(h: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """F.linear of the RMS-normed flat streams, float32. On CUDA in 16 bits one kernel reads
    h once for the linear and the norm, whose scale it applies after the linear (`hc_mix`,
    deepseek_v4/hyper_connection.py): no float32 copy of h."""
    if kernel_applies(h.device, h.dtype):
        return hc_mix(h, fn, eps)
    return F.linear(_flat_rms(h, eps), fn)


def _collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre[t, i] * h[t, i] in float32, in h's dtype (a kernel on CUDA in 16 bits)."""
    if kernel_applies(h.device, h.dtype):
        return hc_collapse(h, pre)
    return _collapse_torch(h, pre)


def _collapse_torch(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * h).sum(dim=1).to(h.dtype)


def _merge_torch(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                 ) -> torch.Tensor:
    dtype = h.dtype
    return (post.to(dtype)[..., None] * out[:, None, :]
            + torch.matmul(comb.to(dtype).transpose(-1, -2), h))


class DeepseekV4HyperConnection(nn.Module):
    """From the hc streams [T, hc, H]: `pre` collapses them into the block input, `post`
    spreads the block output back, `comb` (Sinkhorn-projected towards doubly stochastic)
    mixes the streams: h' = post * out + comb^T h. All weights in float32."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc, self.iters, self.eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = param((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32)
        self.base = param((2 + n) * n, dtype=torch.float32)
        self.scale = param(3, dtype=torch.float32)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (post [T, hc], comb [T, hc, hc], collapsed block input [T, H])."""
        pre, post, comb = self.weights(_mix(h, self.fn, self.norm_eps), h)
        return post, comb, _collapse(h, pre)

    def weights(self, mix: torch.Tensor, h: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mix [T, (2 + hc) hc] -> float32 (pre, post, comb), one kernel on CUDA in 16
        bits (`hc_weights`; h's device and dtype choose)."""
        if kernel_applies(h.device, h.dtype):
            return hc_weights(mix, self.scale, self.base, self.iters, self.eps)
        n, eps = self.hc, self.eps
        pre, post, comb = mix.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_comb = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre * self.scale[0] + b_pre) + eps
        post = 2 * torch.sigmoid(post * self.scale[1] + b_post)
        comb = torch.softmax(comb.unflatten(-1, (n, n)) * self.scale[2] + b_comb.view(n, n),
                             dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return pre, post, comb

    @staticmethod
    def merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
              ) -> torch.Tensor:
        """h' = post * out + comb^T h in h's dtype. On CUDA in 16 bits one kernel sums in
        float32 and rounds once (`hc_merge`); the torch expression rounds post and comb to
        h's dtype and adds two rounded terms."""
        if kernel_applies(h.device, h.dtype):
            return hc_merge(h, out, post, comb)
        return _merge_torch(h, out, post, comb)


class DeepseekV4HyperHead(nn.Module):
    """Final collapse of the hc streams (sigmoid weights, no mixing)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = param(n, n * cfg.hidden_size, dtype=torch.float32)
        self.hc_base = param(n, dtype=torch.float32)
        self.hc_scale = param(1, dtype=torch.float32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mix = _mix(h, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mix * self.hc_scale + self.hc_base) + self.eps
        return _collapse(h, pre)


# ---- layers, model, head ---------------------------------------------------------------------

class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, plan: communicator.LayerPlan, groups: ProcessGroups,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_communicator = communicator.LayerCommunicator(plan, groups)
        self.self_attn = DeepseekV4Attention(cfg, plan.layer, groups, dtype)
        self.mlp = DeepseekV4SparseMoeBlock(cfg, plan.layer, groups, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.attn_hc = DeepseekV4HyperConnection(cfg)
        self.ffn_hc = DeepseekV4HyperConnection(cfg)

    def forward(self, h: torch.Tensor, ropes: dict[str, Rope], batch: ForwardBatch,
                plan: PrefillPlan | DecodeStep) -> torch.Tensor:
        post, comb, x = self.attn_hc(h)
        h = self.attn_hc.merge(h, self._attend(self.input_layernorm(x), ropes, batch, plan),
                               post, comb)
        post, comb, x = self.ffn_hc(h)
        out = self.mlp(self.post_attention_layernorm(x), self.layer_communicator, batch)
        return self.ffn_hc.merge(h, out, post, comb)

    def _attend(self, x_TH: torch.Tensor, ropes: dict[str, Rope], batch: ForwardBatch,
                plan: PrefillPlan | DecodeStep) -> torch.Tensor:
        """Attention of this rank's rows: the forward's `PrefillPlan` (extend) or
        `DecodeStep` (decode) picks the path."""
        attn = self.self_attn
        rope = ropes[attn.rope_name]
        qs, k_side = attn.prepare(x_TH, rope, batch)
        if isinstance(plan, DecodeStep):
            out = decode_attention(attn, qs, k_side, plan, batch.kv, rope.table)
        else:
            out = prefill_attention(attn, qs, k_side, plan, rope.table, batch)
        return attn.finish(out, rope)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, groups: ProcessGroups, dtype: torch.dtype) -> None:
        super().__init__()
        self.hc_mult, self.config, self.cp_rank = cfg.hc_mult, cfg, groups.attn_cp.rank
        self.plans = communicator.plan_layers(groups.layout, [True] * cfg.num_hidden_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, p, groups, dtype)
                                    for p in self.plans)
        self.hc_head = DeepseekV4HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.rope_tables = nn.ModuleDict({
            name: RotaryEmbedding(*rope_inv_freq(spec, cfg.rope_dim))
            for name, spec in (("main", cfg.rope_main), ("compress", cfg.rope_compress))})

    def forward(self, batch: ForwardBatch, step: DecodeStep | None = None) -> torch.Tensor:
        """-> final-normed rows of this rank's tokens [T, H]. A decode step's cache indices:
        `step` (static buffers of a captured graph), else taken from the cache's books for
        batch.cache_keys."""
        x = self.embed_tokens(batch.input_ids)
        ropes = {name: Rope(table, *table(batch.positions, x.dtype))
                 for name, table in self.rope_tables.items()}
        h = x[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        plan: PrefillPlan | DecodeStep
        if not batch.is_decode:
            plan = PrefillPlan.build(batch, self.cp_rank, self.config, x.dtype)
        elif step is not None:
            plan = step
        else:
            assert isinstance(batch.kv, V4Cache) and batch.cache_keys is not None, \
                "V4 decode needs the cache"
            plan = batch.kv.decode_step(batch.cache_keys)
        for layer in self.layers:
            h = layer(h, ropes, batch, plan)
        return self.norm(self.hc_head(h))


class DeepseekV4ForCausalLM(CausalLMHead):
    checkpoint_param_name = staticmethod(checkpoint_param_name)  # read by the loader
    own_cache = True  # per-sequence state, not K/V pages (make_kv_cache, decode_graphs)

    def __init__(self, cfg: DeepseekV4Config, groups: ProcessGroups, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.groups, self.dtype = cfg, groups, dtype
        self.model = DeepseekV4Model(cfg, groups, dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype))

    @staticmethod
    def checkpoint_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
        """Every tensor of a checkpoint of this config, in HF names (CHECKPOINT_RENAMES
        leave them as they are), for random weights at real shapes."""
        return one_rank_checkpoint_shapes(DeepseekV4ForCausalLM, cfg)

    @staticmethod
    def checkpoint_int_ranges(cfg: DeepseekV4Config) -> dict[str, int]:
        """The hash layers' token -> expert tables hold expert ids."""
        return {f"model.layers.{i}.mlp.gate.tid2eid": cfg.num_experts
                for i, kind in enumerate(cfg.mlp_layer_types) if kind == HASH_MOE}

    @staticmethod
    def decode_cache_for(cfg: DeepseekV4Config, layout: ParallelLayout,
                         dtype: torch.dtype) -> str:
        """`cpmoe plan`'s line on the decode cache: per-rank bytes under this layout."""
        return cache_summary(cfg, layout.attn_cp_size, dtype)

    def make_kv_cache(self, capacity: int, max_seqs: int | None = None) -> V4Cache:
        """The runner's `allocate_kv` hook: V4 keeps per-sequence states, not K/V slots; this
        CP rank holds its share of the compressed entries. max_seqs: sequence slots
        (--max-running-requests; None: min(capacity, 256))."""
        cp = self.groups.attn_cp
        return V4Cache(self.config, capacity, self.dtype, self.model.embed_tokens.weight.device,
                       (cp.rank, cp.size), max_seqs)

    def cache_tokens_for_bytes(self, budget: int, max_seqs: int) -> int:
        """The runner's `kv_tokens_for_memory` hook: the most token slots of a cache of
        max_seqs sequence slots within `budget` bytes on this rank (`tokens_for_bytes`)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return tokens_for_bytes(self.config, budget, max_seqs, self.groups.attn_cp.size, elem)

    def can_capture_decode(self) -> bool:
        """The decode step is capture-safe in bf16: V4's clamped SwiGLU experts take the
        grouped-GEMM path there, which reads no counts to the host for decode-sized batches
        (moe/experts.py); other dtypes run the per-expert reference loop."""
        return self.dtype == torch.bfloat16

    def decode_graphs(self, runner, max_bs: int, max_context: int) -> V4DecodeGraphs:
        """The runner's `capture_decode_graphs` hook: CUDA graphs of the decode step over
        this model's own cache (captured on first use per batch and context bucket)."""
        return V4DecodeGraphs(runner, max_bs, min(max_context, runner.kv.capacity))
