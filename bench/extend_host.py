"""Host work of one extend step, counted on the CPU (no GPU needed): aten ops and host
reads of tensor values (each a stream sync on CUDA) per step, for a tiny Qwen3-MoE of
--layers layers, --seqs sequences of --new tokens after --prefix cached tokens each:

    python3 -m bench.extend_host --layers 48 --seqs 6 --new 100 --prefix 256

--decode counts an eager decode step of those sequences instead (the path of a batch
above the CUDA graphs' largest). --engine-step runs the extend as the engine loop does
(`engine.run_step`), one sequence's prompt continuing past the step, so the rows to sample
are picked out of the logits as well.

--cuda-paths takes the model's CUDA branches on the CPU (Tensor.is_cuda reads True; each
Triton kernel, flash-attention and grouped-GEMM call counts as one op, computed by its
reference or stubbed), which is what a GPU step launches; without it, the CPU reference
paths. Reads counted: item/int/bool (aten._local_scalar_dense), tolist, nonzero,
masked_select, repeat_interleave without output_size, and host->device copies
(Tensor.to/copy_ from host memory without non_blocking: a stream sync in PyTorch).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpmoe.bench.spec import SHAPES
from cpmoe.engine.engine import run_step
from cpmoe.engine.request import StepPlan
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.parallel.groups import ProcessGroups

_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default",
             "aten.masked_select.default", "aten.repeat_interleave.Tensor"}


class Counter(TorchDispatchMode):
    """Every aten op run (by name) while active; `paused` counts a fused op as one."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        on_device = MAKING[0] or _on_device(args, kwargs)
        if not self.paused and on_device and not name.startswith(("aten.view", "aten._unsafe_view",
                                                    "aten.t.", "aten.transpose",
                                                    "aten.as_strided", "aten.detach",
                                                    "aten.alias", "aten.split.",
                                                    "aten.slice", "aten.select.",
                                                    "aten.unsqueeze", "aten.expand",
                                                    "aten.split_with_sizes",
                                                    "aten.unbind", "aten.squeeze",
                                                    "aten.permute", "aten.chunk")):
            self.ops[name] += 1
        out = func(*args, **(kwargs or {}))
        if on_device:  # what a GPU step would hold on the device
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    DEVICE.add(id(t))
                    KEEP.append(t)
        if not self.paused and name in _SYNC_OPS and on_device and not (
                name == "aten.repeat_interleave.Tensor" and (kwargs or {}).get("output_size")):
            self.syncs["device: " + name] += 1
        if not self.paused and on_device and name.startswith("aten.index") and any(
                isinstance(t, torch.Tensor) and t.dim() and id(t) not in DEVICE
                for t in torch.utils._pytree.tree_leaves((args[1:], kwargs))):
            # a host index for a device tensor (x[python_list]): PyTorch copies it to the
            # device from pageable memory, a stream sync
            self.syncs["host->device copy: " + name] += 1
        return out


MAKING = [False]  # a factory call on the (fake) CUDA device is running
IN_FORWARD = [False]  # the model's forward is running: its factories make device tensors


DEVICE: set[int] = set()  # ids of tensors a GPU step holds on the device (--cuda-paths)
KEEP: list = []  # ... kept alive, so their ids stay unique


def _on_device(args, kwargs) -> bool:
    return any(isinstance(t, torch.Tensor) and id(t) in DEVICE
               for t in torch.utils._pytree.tree_leaves((args, kwargs)))


COUNTER: Counter | None = None


def _host_reads(counter_name: str, orig):
    def wrapper(self, *a, **k):
        if COUNTER is not None and not COUNTER.paused:
            COUNTER.syncs[("device: " if id(self) in DEVICE else "") + counter_name] += 1
        return orig(self, *a, **k)
    return wrapper


@contextlib.contextmanager
def _one_op(name: str):
    if COUNTER is not None and not COUNTER.paused:
        COUNTER.ops[name] += 1
    if COUNTER is not None:
        COUNTER.paused += 1
    try:
        yield
    finally:
        if COUNTER is not None:
            COUNTER.paused -= 1


def _fused(module, name: str) -> None:
    """Module's `name` (a fused op) counted as one op, computed by its reference."""
    orig = getattr(module, name)

    def wrapper(*a, **k):
        with _one_op("fused." + name):
            return orig(*a, **k)
    setattr(module, name, wrapper)


def take_cuda_paths() -> None:
    """Patches (process-wide, for this script only) that send the model down its CUDA
    branches on CPU tensors."""
    import cpmoe.communicator as communicator
    import cpmoe.cp.attention as attention
    import cpmoe.models.layers as layers
    from cpmoe.models.qwen_moe import model as qwen
    import cpmoe.moe.experts as experts
    import cpmoe.moe.router as router
    import cpmoe.ops as ops

    torch.Tensor.is_cuda = property(lambda self: True)
    ops.launch.use_triton = lambda x: False  # fused ops: their reference, counted as one op
    for mod, names in ((qwen, ("norm_rope", "merge_two_attention", "qkv_norm_rope_store",
                               "paged_decode_attention")),
                       (layers, ("add_rms_norm",)), (router, ("softmax_topk",)),
                       (experts, ("silu_and_mul", "weighted_row_sum")),
                       (communicator, ("merge_partials",))):
        for n in names:
            _fused(mod, n)
    rms = layers.RMSNorm.forward

    def rms_forward(self, x):  # F.rms_norm: one kernel on the GPU
        with _one_op("fused.rms_norm"):
            return rms(self, x)
    layers.RMSNorm.forward = rms_forward

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        with _one_op("flash.varlen"):
            return q.new_zeros(q.shape), torch.zeros(q.shape[:2])
    attention.varlen_attention = varlen

    def with_lse(q, k, v, causal, scale):
        with _one_op("sdpa.with_lse"):
            return q.new_zeros(q.shape), torch.zeros(q.shape[:3])
    attention.attention_with_lse = with_lse

    def grouped_mm(x, w, offs):
        with _one_op("grouped_mm"):
            return x.new_zeros(x.shape[0], w.shape[-1])
    experts._grouped_mm = grouped_mm


def _cpu(device):
    return "cpu" if isinstance(device, (str, torch.device)) and "cuda" in str(device) else device


def _device(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    if cuda:
        DEVICE.add(id(t))
        KEEP.append(t)
    return t


def fake_cuda_device(runner) -> None:
    """In the model's forward every tensor is on the device.
    The runner's device reads "cuda"; tensors it asks there stay on the CPU, and every
    copy from the host to it without non_blocking counts as a host read (a stream sync)."""
    runner.device = torch.device("cuda")
    for name in ("hidden_states", "logits"):
        orig = getattr(runner.model, name)

        def forward(*a, _orig=orig, **k):
            IN_FORWARD[0] = True
            try:
                return _orig(*a, **k)
            finally:
                IN_FORWARD[0] = False
        setattr(runner.model, name, forward)

    def h2d(kwargs, device) -> None:
        if COUNTER is not None and not COUNTER.paused and device is not None and \
                "cuda" in str(device) and not kwargs.get("non_blocking"):
            COUNTER.syncs["host->device copy"] += 1

    # tensor/as_tensor copy host data (a host->device copy when given a CUDA device); the
    # others fill on the device
    for name in ("tensor", "as_tensor", "arange", "zeros", "full", "empty", "ones"):
        orig = getattr(torch, name)

        def factory(*a, _orig=orig, _copies=name in ("tensor", "as_tensor"), **k):
            if _copies:
                h2d(k, k.get("device"))
            else:
                k.pop("pin_memory", None)  # no pinned memory without CUDA
            cuda = "cuda" in str(k.get("device")) or IN_FORWARD[0]
            k["device"] = _cpu(k.get("device"))
            MAKING[0] = cuda
            try:
                return _device(_orig(*a, **k), cuda)
            finally:
                MAKING[0] = False
        setattr(torch, name, factory)
    to = torch.Tensor.to

    def tensor_to(self, *a, **k):
        dev = k.get("device", a[0] if a and isinstance(a[0], (str, torch.device)) else None)
        h2d(k, dev)
        a = tuple(_cpu(x) for x in a)
        if "device" in k:
            k["device"] = _cpu(k["device"])
        out = to(self, *a, **k)
        cuda = dev is not None and "cuda" in str(dev)
        if cuda and id(self) not in DEVICE:  # a copy to the GPU
            if COUNTER is not None and not COUNTER.paused:
                COUNTER.ops["host->device copy"] += 1
            if out is self:
                out = self.clone()
        return _device(out, cuda)
    torch.Tensor.to = tensor_to


def _prompts(segs: list[Segment]) -> SimpleNamespace:
    """What run_step reads of the scheduler: each running request's tokens. The last
    sequence's prompt runs past this step (a chunk), so only the others are sampled."""
    return SimpleNamespace(running={
        g.key: SimpleNamespace(tokens=[0] * (g.start + len(g.ids) + (i == len(segs) - 1)))
        for i, g in enumerate(segs)})


def main() -> None:
    global COUNTER
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--seqs", type=int, default=6)
    p.add_argument("--new", type=int, default=100)
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--cuda-paths", action="store_true")
    p.add_argument("--top", type=int, default=0, help="print the N most frequent ops")
    p.add_argument("--decode", action="store_true",
                   help="count an eager decode step of the sequences instead (no graphs: "
                        "a batch above --cuda-graph-max-bs, or --disable-cuda-graph)")
    p.add_argument("--engine-step", action="store_true",
                   help="run the step as the engine does (engine.run_step), the last "
                        "sequence's prompt not yet complete: the logits rows picked too")
    args = p.parse_args()
    cfg = {**SHAPES["tiny"], "num_hidden_layers": args.layers}
    dtype = torch.float32
    if args.cuda_paths:
        take_cuda_paths()
        dtype = torch.bfloat16
    runner = ModelRunner.from_config(cfg, ProcessGroups.single("cpu"), dtype)
    if args.cuda_paths:
        runner.model.fuse_weights()  # as _finish_load does on CUDA
        fake_cuda_device(runner)
    runner.allocate_kv(args.prefix + args.seqs * args.new * 2 + 256, 16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg["vocab_size"], (args.prefix + args.seqs * args.new,),
                        generator=gen).tolist()
    if args.prefix:
        runner.extend([Segment(0, ids[:args.prefix])])
    segs = []
    for i in range(args.seqs):
        if args.prefix:  # else new sequences
            runner.kv.fork(i + 1, 0, args.prefix)
        segs.append(Segment(i + 1, ids[args.prefix + i * args.new:
                                       args.prefix + (i + 1) * args.new], args.prefix))
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "cpu")}
    for n, f in saved.items():
        setattr(torch.Tensor, n, _host_reads(n, f))
    COUNTER = Counter()
    MAKING[0] = not args.cuda_paths  # CPU paths: every tensor is "on the device"
    with COUNTER:
        if args.decode:
            runner.decode([g.key for g in segs], [g.ids[0] for g in segs])
        elif args.engine_step:
            run_step(runner, StepPlan(extend=[(g.key, g.ids, g.start) for g in segs]),
                     _prompts(segs))
        else:
            runner.extend(segs)
    for n, f in saved.items():
        setattr(torch.Tensor, n, f)
    ops = sum(COUNTER.ops.values())
    syncs = sum(n for k, n in COUNTER.syncs.items() if k.startswith(("device", "host->")))
    print(f"{'CUDA' if args.cuda_paths else 'CPU'} paths, {args.layers} layers, {args.seqs} x "
          f"{args.new} new after {args.prefix}: {ops} device ops/step ({ops / args.layers:.1f}"
          f" per layer), {syncs} syncs/step; reads: {dict(COUNTER.syncs)}")
    for name, n in COUNTER.ops.most_common(args.top):
        print(f"  {n:6d}  {name}")


if __name__ == "__main__":
    main()
