"""Tests for cpmoe.loader: one-rank and sharded loads of HF checkpoints, and every refusal.

Sharded loads run without torch.distributed: a rank's `ProcessGroups` is built by hand from
the layout (loading issues no collective), and each rank's shard is compared with the slice
of the HF tensor that the reference semantics assign to it. The expected slices are computed
here from the layout coordinates, not read back from the model's shard annotations.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cpmoe.config import ConfigError
from cpmoe.engine.runner import ModelRunner
from cpmoe.loader import LoadError, load_checkpoint
from cpmoe.models.qwen_moe.model import QwenMoeForCausalLM
from cpmoe.models.registry import check_model_fit, load_model_config
from cpmoe.parallel.groups import Group, ProcessGroups
from cpmoe.parallel.layout import GROUP_KINDS, ParallelLayout

KINDS = ("qwen3_moe", "qwen2_moe")

# ---- helpers ----------------------------------------------------------------------------


def rank_groups(layout: ParallelLayout, rank: int) -> ProcessGroups:
    """Rank `rank`'s ProcessGroups without torch.distributed (no ProcessGroup objects)."""
    groups = {}
    for kind in GROUP_KINDS:
        members = layout.group_of(kind, rank)
        groups[kind] = Group(kind, tuple(members), members.index(rank), None)
    world = list(range(layout.world_size))
    groups["world"] = Group("world", tuple(world), rank, None)
    return ProcessGroups(layout=layout, rank=rank, device=torch.device("cpu"), **groups)


def load_rank(model_dir: Path, layout: ParallelLayout, rank: int):
    """-> (model shard of `rank`, load stats)."""
    cfg, model_cls = load_model_config(model_dir)
    assert model_cls is QwenMoeForCausalLM
    check_model_fit(layout, cfg)
    model = QwenMoeForCausalLM(cfg, rank_groups(layout, rank), torch.float32)
    stats = load_checkpoint(model, model_dir, show_progress=False,
                            tied_embeddings=cfg.tie_word_embeddings)
    return model, stats


def load_single(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, ProcessGroups.single(), torch.float32, show_progress=False)


def hf_params(hf_model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in hf_model.named_parameters()}


def file_tensor_names(model_dir: Path) -> list[str]:
    names = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            names.extend(h.keys())
    return names


_EXPERT_FILE = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_DENSE = re.compile(r"layers\.\d+\.mlp\.(gate|up|down)_proj\.weight$")

ALL = ...


def shard_map(name: str, layout: ParallelLayout, rank: int, cfg) -> list[tuple]:
    """(local index, full index) pairs: local_param[li] == full_hf_tensor[fi], covering the
    whole local parameter. Written from the reference semantics, independently of the loader."""
    c = layout.coords(rank)
    atp, a = layout.attn_tp_size, c["attn_tp"]
    D, nh, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads

    def rows(start: int, stop: int) -> list[tuple]:
        return [(ALL, (slice(start, stop),))]

    if ".self_attn.q_proj." in name:  # weight and bias: this rank's query heads
        n = nh // atp * D
        return rows(a * n, (a + 1) * n)
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        if kv >= atp:
            n = kv // atp * D
            return rows(a * n, (a + 1) * n)
        # fewer KV heads than ranks: the one KV head this rank's query heads read
        head = (a * (nh // atp)) // (nh // kv)
        return rows(head * D, (head + 1) * D)
    if name.endswith(".self_attn.o_proj.weight"):
        n = nh // atp * D
        return [(ALL, (slice(None), slice(a * n, (a + 1) * n)))]
    if _DENSE.search(name) and ".shared_expert." not in name:  # dense MLP over attention TP
        n = cfg.intermediate_size // atp
        if name.endswith("down_proj.weight"):
            return [(ALL, (slice(None), slice(a * n, (a + 1) * n)))]
        return rows(a * n, (a + 1) * n)
    if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
        e_loc = cfg.num_experts // layout.ep_size
        e0 = c["moe_ep"] * e_loc
        inter, t = cfg.moe_intermediate_size, c["moe_tp"]
        it = inter // layout.moe_tp_size
        pairs = []
        for le in range(e_loc):
            e = e0 + le
            if name.endswith("gate_up_proj"):  # gate rows first, then up rows
                pairs.append(((le, slice(0, it)), (e, slice(t * it, (t + 1) * it))))
                pairs.append(((le, slice(it, 2 * it)),
                              (e, slice(inter + t * it, inter + (t + 1) * it))))
            else:
                pairs.append(((le,), (e, slice(None), slice(t * it, (t + 1) * it))))
        return pairs
    return [(ALL, ALL)]  # replicated: norms, embeddings, router, shared expert, lm_head


def one_line(msg: str) -> str:
    assert msg and "\n" not in msg, repr(msg)
    return msg


def rewrite(src: Path, dst: Path, mutate) -> Path:
    """Copy config.json and a mutated model.safetensors of checkpoint `src` into `dst`."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpt(qwen3_moe_dir, qwen2_moe_dir, hf_models):
    """kind -> (dir, HF params)."""
    dirs = {"qwen3_moe": qwen3_moe_dir, "qwen2_moe": qwen2_moe_dir}
    return {k: (dirs[k], hf_params(hf_models[k])) for k in KINDS}


# ---- one-rank loads ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_single_rank_load_equals_hf(kind, ckpt):
    model_dir, hf = ckpt[kind]
    runner = load_single(model_dir)
    params = dict(runner.model.named_parameters())
    assert set(params) == set(hf)  # same names as HF transformers 5, nothing extra or missing
    for name, p in params.items():
        assert p.dtype == torch.float32
        assert p.shape == hf[name].shape, name
        assert torch.equal(p, hf[name]), name
    total = len(file_tensor_names(model_dir))
    assert runner.load_stats["loaded"] == total
    assert runner.load_stats["skipped"] == 0
    assert runner.load_stats["bytes"] == runner.weight_bytes()


@pytest.mark.parametrize("kind", KINDS)
def test_single_rank_experts_match_hub_tensors(kind, ckpt):
    """The fused gate_up_proj/down_proj hold the file's per-expert tensors (gate rows first)."""
    model_dir, _ = ckpt[kind]
    model = load_single(model_dir).model
    params = dict(model.named_parameters())
    tensors = load_file(str(model_dir / "model.safetensors"))
    found = re.findall(r"layers\.(\d+)\.mlp\.experts\.", " ".join(tensors))
    sparse = sorted({int(m) for m in found})
    assert sparse == ([0, 2] if kind == "qwen3_moe" else [0, 1])
    inter = model.config.moe_intermediate_size
    for layer in sparse:
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(model.config.num_experts):
            gu = params[f"{p}.gate_up_proj"][e]
            assert torch.equal(gu[:inter], tensors[f"{p}.{e}.gate_proj.weight"])
            assert torch.equal(gu[inter:], tensors[f"{p}.{e}.up_proj.weight"])
            assert torch.equal(params[f"{p}.down_proj"][e], tensors[f"{p}.{e}.down_proj.weight"])
    # spot checks of non-expert tensors, straight from the file
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(params[q], tensors[q])
    if kind == "qwen2_moe":
        for b in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.1.self_attn.{b}.bias"
            assert torch.equal(params[name], tensors[name]) and tensors[name].abs().sum() > 0


def test_fixture_routing_is_decisive(ckpt, hf_models):
    """The fixture's routers are scaled: the k-th and (k+1)-th expert probabilities are well
    apart for random hidden rows, so fp32 rounding differences cannot flip top-k."""
    for kind in KINDS:
        _, hf = ckpt[kind]
        k = hf_models[kind].config.num_experts_per_tok
        x = torch.nn.functional.rms_norm(torch.randn(256, 64, generator=torch.Generator()
                                                     .manual_seed(3)), (64,))
        for name, w in hf.items():
            if name.endswith("mlp.gate.weight"):
                probs = torch.softmax(x @ w.T, dim=-1).sort(dim=-1, descending=True).values
                gap = probs[:, k - 1] - probs[:, k]
                assert gap.median() > 0.015, (kind, name, gap.median())  # ~0.006 unscaled


# ---- sharded loads ----------------------------------------------------------------------

LAYOUTS = [
    dict(tp_size=2, ep_size=2),
    dict(tp_size=4, ep_size=4),  # attn_tp 4 > 2 KV heads: replicated
    dict(tp_size=4, ep_size=4, moe_a2a_backend="alltoall"),
    dict(tp_size=4, ep_size=1),  # pure MoE-TP 4
    dict(tp_size=4, attn_cp_size=2, moe_dp_size=1, ep_size=4),  # decoupled
    dict(tp_size=4, attn_cp_size=2, moe_dp_size=2, ep_size=1),  # coupled, MoE-TP 2
    dict(tp_size=8, attn_cp_size=4, ep_size=8),  # one expert per rank
    dict(tp_size=8, ep_size=8),  # attn_tp 8: each KV head on 4 ranks
    dict(tp_size=8, attn_cp_size=2, moe_dp_size=2, ep_size=1),  # MoE-TP 4, 2 expert copies
    dict(tp_size=4, ep_size=2),  # EP 2 x MoE-TP 2
    dict(tp_size=8, attn_cp_size=2, ep_size=4),  # EP 4 x MoE-TP 2
    dict(tp_size=8, attn_cp_size=4, ep_size=2),  # EP 2 x MoE-TP 4
]


def _layout_id(kw: dict) -> str:
    return "-".join(f"{k.split('_')[0] if k != 'moe_a2a_backend' else ''}{v}"
                    for k, v in kw.items())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout_kwargs", LAYOUTS, ids=_layout_id)
def test_sharded_load_slices(kind, layout_kwargs, ckpt):
    model_dir, hf = ckpt[kind]
    layout = ParallelLayout(**layout_kwargs)
    names = file_tensor_names(model_dir)
    n_expert_tensors = sum(bool(_EXPERT_FILE.search(n)) for n in names)
    covered = {name: torch.zeros_like(t, dtype=torch.bool) for name, t in hf.items()}
    for rank in range(layout.world_size):
        model, stats = load_rank(model_dir, layout, rank)
        cfg = model.config
        params = dict(model.named_parameters())
        assert set(params) == set(hf)
        # every tensor of other EP ranks' experts skipped, everything else loaded
        expected_skipped = n_expert_tensors - n_expert_tensors // layout.ep_size
        assert stats["skipped"] == expected_skipped, (rank, stats)
        assert stats["loaded"] == len(names) - expected_skipped
        assert stats["bytes"] == sum(p.numel() * p.element_size() for p in params.values())
        for name, local in params.items():
            full = hf[name]
            seen_local = torch.zeros_like(local, dtype=torch.bool)
            for li, fi in shard_map(name, layout, rank, cfg):
                assert local[li].shape == full[fi].shape, (rank, name, li, fi)
                assert torch.equal(local[li], full[fi]), (rank, name, li, fi)
                seen_local[li] = True
                covered[name][fi] = True
            assert seen_local.all(), (rank, name)  # the map describes the whole local shard
    for name, mask in covered.items():
        assert mask.all(), f"union of shards misses part of {name}"


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_kv_heads_replicated(kind, ckpt):
    """tp=4, attn_cp=1: attn_tp 4 > 2 KV heads -> ranks 0,1 hold KV head 0, ranks 2,3 head 1."""
    model_dir, hf = ckpt[kind]
    layout = ParallelLayout(tp_size=4, ep_size=4)
    D = 16 if kind == "qwen3_moe" else 8
    for rank in range(4):
        model, _ = load_rank(model_dir, layout, rank)
        attn = model.model.layers[0].self_attn
        assert attn.num_kv_heads == 1 and attn.num_heads == 2
        head = rank // 2
        for proj in ("k_proj", "v_proj"):
            w = hf[f"model.layers.0.self_attn.{proj}.weight"]
            assert torch.equal(getattr(attn, proj).weight, w[head * D:(head + 1) * D])
            if kind == "qwen2_moe":
                b = hf[f"model.layers.0.self_attn.{proj}.bias"]
                assert torch.equal(getattr(attn, proj).bias, b[head * D:(head + 1) * D])


def test_sharded_experts_owned_by_ep_rank(ckpt):
    """tp=8, ep=8: rank r holds exactly expert r of every sparse layer, whole."""
    model_dir, hf = ckpt["qwen3_moe"]
    layout = ParallelLayout(tp_size=8, attn_cp_size=4, ep_size=8)
    for rank in range(8):
        model, stats = load_rank(model_dir, layout, rank)
        for layer in (0, 2):
            ex = model.model.layers[layer].mlp.experts
            assert ex.gate_up_proj.shape == (1, 64, 64) and ex.down_proj.shape == (1, 64, 32)
            p = f"model.layers.{layer}.mlp.experts"
            assert torch.equal(ex.gate_up_proj[0], hf[f"{p}.gate_up_proj"][rank])
            assert torch.equal(ex.down_proj[0], hf[f"{p}.down_proj"][rank])
        assert stats["skipped"] == 2 * 7 * 3


def test_sharded_moe_tp_intermediate_slices(ckpt):
    """tp=4, ep=1: every rank holds all 8 experts, intermediate rows [8r, 8r+8) of 32."""
    model_dir, hf = ckpt["qwen2_moe"]
    layout = ParallelLayout(tp_size=4, ep_size=1)
    for rank in range(4):
        model, stats = load_rank(model_dir, layout, rank)
        assert stats["skipped"] == 0
        ex = model.model.layers[0].mlp.experts
        full_gu = hf["model.layers.0.mlp.experts.gate_up_proj"]
        full_dn = hf["model.layers.0.mlp.experts.down_proj"]
        rows = slice(8 * rank, 8 * rank + 8)
        up_rows = slice(32 + 8 * rank, 32 + 8 * rank + 8)
        assert ex.gate_up_proj.shape == (8, 16, 64)
        assert torch.equal(ex.gate_up_proj[:, :8], full_gu[:, rows])
        assert torch.equal(ex.gate_up_proj[:, 8:], full_gu[:, up_rows])
        assert torch.equal(ex.down_proj, full_dn[:, :, rows])
        # the shared expert is replicated, never sharded
        se = model.model.layers[0].mlp.shared_expert
        assert torch.equal(se.gate_proj.weight,
                           hf["model.layers.0.mlp.shared_expert.gate_proj.weight"])


class _CountingHandle:
    """A safetensors handle that counts the elements each slice read returns."""

    def __init__(self, handle) -> None:
        self.handle, self.read = handle, 0

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name):
        sl, outer = self.handle.get_slice(name), self

        class _Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, index):
                data = sl[index]
                outer.read += data.numel()
                return data

        return _Slice()


@pytest.mark.parametrize("layout_kwargs", [dict(tp_size=4, ep_size=2),
                                           dict(tp_size=8, attn_cp_size=4, ep_size=2)],
                         ids=_layout_id)
def test_hybrid_ranks_read_only_their_expert_slices(layout_kwargs, ckpt):
    """EP x MoE-TP: each rank reads exactly its experts' intermediate slices from the file
    (elements read == elements of its shard), and the shards of one MoE group together
    read every expert element exactly once."""
    from cpmoe.loader import fill_parameters

    model_dir, hf = ckpt["qwen2_moe"]
    layout = ParallelLayout(**layout_kwargs)
    cfg, _ = load_model_config(model_dir)
    expert_reads = 0
    for rank in range(layout.world_size):
        model = QwenMoeForCausalLM(cfg, rank_groups(layout, rank), torch.float32)
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as h:
            counting = _CountingHandle(h)
            fill_parameters(model, [(model_dir / "model.safetensors", counting)], str(model_dir),
                            show_progress=False, tied_embeddings=False)
        params = dict(model.named_parameters())
        assert counting.read == sum(p.numel() for p in params.values()), rank
        expert_reads += sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    full_experts = sum(t.numel() for n, t in hf.items() if ".mlp.experts." in n)
    assert expert_reads == full_experts  # moe_dp 1: one copy of the experts over the world


# ---- sharded checkpoint files (model.safetensors.index.json) -----------------------------


@pytest.fixture(scope="module")
def indexed_ckpt(hf_models, tmp_path_factory):
    """kind -> dir of the same weights saved in several files with an index."""
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(f"{kind}_indexed")
        hf_models[kind].save_pretrained(str(d), max_shard_size="200KB")
        out[kind] = d
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_indexed_checkpoint_loads_same_values(kind, ckpt, indexed_ckpt):
    model_dir, hf = ckpt[kind]
    d = indexed_ckpt[kind]
    assert (d / "model.safetensors.index.json").exists()
    assert not (d / "model.safetensors").exists()
    files = sorted(d.glob("*.safetensors"))
    assert len(files) >= 3
    runner = load_single(d)
    for name, p in runner.model.named_parameters():
        assert torch.equal(p, hf[name]), name
    assert runner.load_stats["loaded"] == len(file_tensor_names(model_dir))
    layout = ParallelLayout(tp_size=4, attn_cp_size=2, ep_size=4)
    for rank in range(4):
        a, sa = load_rank(d, layout, rank)
        b, sb = load_rank(model_dir, layout, rank)
        assert sa == sb
        pb = dict(b.named_parameters())
        for name, p in a.named_parameters():
            assert torch.equal(p, pb[name]), (rank, name)


def test_index_missing_shard_file(indexed_ckpt, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(indexed_ckpt["qwen3_moe"], d)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    victim = sorted(set(weight_map.values()))[1]
    (d / victim).unlink()
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert victim in one_line(str(info.value))


def test_index_unreadable(indexed_ckpt, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(indexed_ckpt["qwen3_moe"], d)
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert "model.safetensors.index.json" in one_line(str(info.value))


def test_index_tensor_in_two_files(indexed_ckpt, tmp_path):
    """A tensor stored in two shard files fills its parameter twice: refused, named."""
    d = tmp_path / "ck"
    shutil.copytree(indexed_ckpt["qwen3_moe"], d)
    files = sorted(d.glob("*.safetensors"))
    first, last = load_file(str(files[0])), load_file(str(files[-1]))
    dup = sorted(first)[0]
    last[dup] = first[dup]
    save_file(last, str(files[-1]), metadata={"format": "pt"})
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert dup in one_line(str(info.value))


# ---- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
     "model.norm.weight", "lm_head.weight", "model.layers.2.mlp.gate.weight"],
)
def test_missing_tensor(tensor, qwen3_moe_dir, tmp_path):
    d = rewrite(qwen3_moe_dir, tmp_path / "ck", lambda t: t.pop(tensor))
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert tensor in one_line(str(info.value))


def test_missing_qkv_bias(qwen2_moe_dir, tmp_path):
    tensor = "model.layers.1.self_attn.k_proj.bias"
    d = rewrite(qwen2_moe_dir, tmp_path / "ck", lambda t: t.pop(tensor))
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert tensor in one_line(str(info.value))


def test_missing_expert_tensor_refused(qwen3_moe_dir, tmp_path):
    tensor = "model.layers.2.mlp.experts.3.up_proj.weight"
    d = rewrite(qwen3_moe_dir, tmp_path / "ck", lambda t: t.pop(tensor))
    with pytest.raises(LoadError) as info:
        load_single(d)
    msg = one_line(str(info.value))
    assert "model.layers.2.mlp.experts" in msg
    # sharded: only the EP rank that owns expert 3 (of 8 over ep=2: rank 0) notices
    layout = ParallelLayout(tp_size=2, ep_size=2)
    with pytest.raises(LoadError):
        load_rank(d, layout, 0)
    load_rank(d, layout, 1)


def test_missing_expert_tensor_message_names_tensor(qwen3_moe_dir, tmp_path):
    tensor = "model.layers.2.mlp.experts.3.up_proj.weight"
    d = rewrite(qwen3_moe_dir, tmp_path / "ck", lambda t: t.pop(tensor))
    with pytest.raises(LoadError) as info:
        load_single(d)
    msg = one_line(str(info.value))
    assert "experts.3.up_proj" in msg, msg


@pytest.mark.parametrize(
    "tensor, value",
    [
        ("model.layers.0.self_attn.extra_proj.weight", torch.zeros(4, 64)),
        ("model.layers.1.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64)),  # dense layer
        ("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64)),  # expert 8 of 8
        ("model.layers.3.input_layernorm.weight", torch.ones(64)),  # layer 3 of 3
        ("model.layers.0.mlp.shared_expert_gate.weight", torch.zeros(1, 64)),  # Qwen2 only
    ],
)
def test_unexpected_tensor(tensor, value, qwen3_moe_dir, tmp_path):
    d = rewrite(qwen3_moe_dir, tmp_path / "ck", lambda t: t.__setitem__(tensor, value))
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert tensor in one_line(str(info.value))


def test_unexpected_out_of_range_expert_refused_on_every_rank(qwen3_moe_dir, tmp_path):
    tensor = "model.layers.0.mlp.experts.9.down_proj.weight"
    d = rewrite(qwen3_moe_dir, tmp_path / "ck",
                lambda t: t.__setitem__(tensor, torch.zeros(64, 32)))
    layout = ParallelLayout(tp_size=4, ep_size=4)
    for rank in range(4):
        with pytest.raises(LoadError) as info:
            load_rank(d, layout, rank)
        assert tensor in one_line(str(info.value))


@pytest.mark.parametrize(
    "tensor, shape",
    [
        ("model.layers.0.self_attn.q_proj.weight", (128, 63)),
        ("model.layers.0.self_attn.o_proj.weight", (64, 64)),
        ("model.layers.0.self_attn.k_proj.weight", (16, 64)),
        ("model.layers.0.mlp.experts.1.down_proj.weight", (64, 31)),
        ("model.layers.2.mlp.experts.7.gate_proj.weight", (33, 64)),
        ("model.layers.1.mlp.up_proj.weight", (64, 64)),
        ("model.norm.weight", (65,)),
        ("model.embed_tokens.weight", (255, 64)),
        ("model.layers.0.mlp.gate.weight", (7, 64)),
    ],
)
def test_wrong_shape(tensor, shape, qwen3_moe_dir, tmp_path):
    d = rewrite(qwen3_moe_dir, tmp_path / "ck",
                lambda t: t.__setitem__(tensor, torch.zeros(shape)))
    with pytest.raises(LoadError) as info:
        load_single(d)
    msg = one_line(str(info.value))
    assert tensor in msg and str(list(shape)) in msg


def test_wrong_shape_refused_on_sharded_ranks(qwen3_moe_dir, tmp_path):
    """The full shape is checked even where the rank reads only a slice of the tensor."""
    tensor = "model.layers.0.self_attn.q_proj.weight"
    d = rewrite(qwen3_moe_dir, tmp_path / "ck",
                lambda t: t.__setitem__(tensor, torch.zeros(136, 64)))  # 8.5 heads
    layout = ParallelLayout(tp_size=4, attn_cp_size=2, ep_size=4)
    for rank in range(4):
        with pytest.raises(LoadError) as info:
            load_rank(d, layout, rank)
        assert tensor in one_line(str(info.value))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garbage_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 64 + data[64:])


def _garbage_json(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"{garbage" + data[16:])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _trailing_bytes(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"junk")


@pytest.mark.parametrize("corrupt", [_truncate, _garbage_header, _garbage_json, _empty,
                                     _trailing_bytes])
def test_corrupt_file(corrupt, qwen3_moe_dir, tmp_path):
    d = rewrite(qwen3_moe_dir, tmp_path / "ck", lambda t: None)
    corrupt(d / "model.safetensors")
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert "model.safetensors" in one_line(str(info.value))


def test_missing_weights_file(qwen3_moe_dir, tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(qwen3_moe_dir / "config.json", d / "config.json")
    with pytest.raises(LoadError) as info:
        load_single(d)
    assert "model.safetensors" in one_line(str(info.value))


def test_unsupported_architecture(qwen3_moe_dir, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(qwen3_moe_dir, d)
    raw = json.loads((d / "config.json").read_text())
    raw["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_single(d)
    msg = one_line(str(info.value))
    assert "LlamaForCausalLM" in msg and "config.json" in msg


def test_missing_config_json(qwen3_moe_dir, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(qwen3_moe_dir, d)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError) as info:
        load_single(d)
    assert "config.json" in one_line(str(info.value))


def test_other_dtype_in_file_is_cast(qwen3_moe_dir, tmp_path, ckpt):
    """A bf16 tensor in the file loads into the float32 model (cast, not refused)."""
    tensor = "model.norm.weight"
    d = rewrite(qwen3_moe_dir, tmp_path / "ck",
                lambda t: t.__setitem__(tensor, t[tensor].to(torch.bfloat16)))
    params = dict(load_single(d).model.named_parameters())
    assert torch.equal(params[tensor], ckpt["qwen3_moe"][1][tensor].bfloat16().float())


def test_tied_embeddings(make_hf_checkpoint):
    """tie_word_embeddings: no lm_head parameter; logits use embed_tokens."""
    hf_model, d = make_hf_checkpoint("qwen3_moe", tie_word_embeddings=True)
    runner = load_single(d)
    assert runner.model.lm_head is None
    hf = hf_params(hf_model)
    for name, p in runner.model.named_parameters():
        assert torch.equal(p, hf[name]), name
    h = torch.randn(3, 64)
    assert torch.equal(runner.model.logits(h), h @ hf["model.embed_tokens.weight"].T)
