"""`cpmoe check`: a layout against the one-rank reference on the same prompts.

Every rank runs the layout over every batch; then rank 0 frees it and runs the one-rank
reference (its peers are done by then). For each batch of prompts:
- prefill: logits of every position (max |difference|), the first generated token (the
  argmax at each prompt's last position) and its log-probability;
- decode: `decode_steps` steps on both, fed the same tokens (drawn per prompt from the seed,
  so every rank has them without communication), logits compared at every step;
- routing, on the reference: each prompt's smallest top-k margin, the k-th largest minus the
  (k+1)-th router logit (as the router computes them, in the model's dtype) over every
  sparse layer and position, prefill and decode. Below `near_tie` x max(1, |k-th logit|) the
  expert set of that token is decided by rounding: a layout sums in another order and may
  route that token differently, which is a tie broken two ways, not a layout error. Such
  prompts are flagged, so a reader can tell such a mismatch or logit difference from a bug.

Verdict (`failures`): a prompt fails on a first-token mismatch, and in float32 also on a
decode step whose top-1 differs (in 16-bit dtypes layouts differ by rounding, and random
weights leave near-tied top logits: decode top-1 differences are reported, not failed).
A routing near-tie excuses nothing: with many rows per prompt most long prompts have one.

- indexer (DeepSeek-V4, float32), on the reference: each prompt's smallest margin at the
  lightning indexer's top-k cut (the k-th minus the (k+1)-th best score a query may see),
  flagged below the same `near_tie` bound: entries that close are picked by rounding, and a
  layout may pick the other (`IndexerMargins`; exact ties at 0 are not near-ties: the
  reference's top-k decides them and cpmoe takes it in every layout).

Progress goes to stderr after each batch's comparison. Only routers of the Qwen-MoE kind
(`SoftmaxTopKRouter`) are measured; for other models the routing margins are reported as
unknown.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cpmoe.cp.kv_capacity import kv_slots_needed
from cpmoe.engine.runner import ModelRunner, Segment
from cpmoe.engine.rank_tasks import RunSpec, build_runner
from cpmoe.models.deepseek_v4.indexer import ReferenceTopK
from cpmoe.moe.router import SoftmaxTopKRouter
from cpmoe.parallel.groups import ProcessGroups
from cpmoe.parallel.launch import RankInfo

# near_tie defaults. float32: layouts' logits agree with one rank to about 2e-6 (tests:
# within 1e-5), so a router logit can move that much on each side of a margin; 1e-5 is 2.5x
# the 4e-6 that can flip one (on the built-in model, 1 of 16,384 router rows of a 4096-token
# prompt falls below it). 16-bit: a router logit is itself rounded to 2^-8 relative, so a
# margin within one such rounding is a tie of the arithmetic; at these dtypes long prompts
# nearly always hold one, which the report then says.
NEAR_TIE_DEFAULT = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-8}


@dataclass
class PromptReport:
    length: int
    first_token_match: bool = True
    logprob_delta: float = 0.0
    max_abs_diff: float = 0.0  # prefill, every position
    decode_max_abs_diff: float = 0.0
    decode_top1_mismatches: int = 0
    margin: float | None = None  # smallest top-k routing margin (None: not measured)
    margin_at: tuple[int, int] | None = None  # (layer, position)
    near_tie: bool = False
    # DeepSeek-V4's indexer, float32 (`IndexerMargins`): None where not measured, inf where
    # no row had more visible entries than its top-k
    index_margin: float | None = None
    index_margin_at: tuple[int, int] | None = None
    index_near_tie: bool = False


@dataclass
class CheckReport:
    decode_steps: int
    near_tie: float
    strict_decode: bool = True  # decode top-1 mismatches fail (float32)
    prompts: list[PromptReport] = field(default_factory=list)

    @property
    def matches(self) -> int:
        return sum(p.first_token_match for p in self.prompts)

    @property
    def max_abs_diff(self) -> float:
        return max((p.max_abs_diff for p in self.prompts), default=0.0)

    @property
    def mean_logprob_delta(self) -> float:
        return sum(p.logprob_delta for p in self.prompts) / max(1, len(self.prompts))

    def failures(self) -> list[int]:
        """Prompts with a first-token mismatch, or (strict_decode) a decode top-1 one."""
        return [i for i, p in enumerate(self.prompts) if not p.first_token_match or
                (self.strict_decode and p.decode_top1_mismatches)]


class _Margins:
    """Forward hooks on a model's top-k modules: while `rows` names each row of a forward
    (prompt, position), every hooked call records each prompt's smallest margin at the
    top-k cut and whether any of its rows is a near-tie (`record`)."""

    def __init__(self, model: torch.nn.Module, near_tie: float, kind: type) -> None:
        self.near_tie = near_tie
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None  # prompt ids, positions
        self.best: dict[int, list] = {}  # prompt -> [margin, layer, position, near_tie]
        self.modules = 0
        for name, module in model.named_modules():
            if isinstance(module, kind):
                layer = int(m[1]) if (m := re.search(r"layers\.(\d+)\.", name)) else -1
                module.register_forward_hook(self._hook(layer))
                self.modules += 1

    def name_rows(self, rows: list[tuple[int, int]] | None) -> None:
        self.rows = None if rows is None else tuple(torch.tensor(c) for c in zip(*rows))

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, inputs, _output) -> None:
            if self.rows is not None:
                self.measure(layer, module, inputs)
        return hook

    def measure(self, layer: int, module: torch.nn.Module, inputs: tuple) -> None:
        raise NotImplementedError

    def record(self, layer: int, rows: torch.Tensor, margin: torch.Tensor,
               tie: torch.Tensor) -> None:
        """margin, tie [n] of the forward's rows `rows` [n] (margin inf: no cut)."""
        assert self.rows is not None
        prompt_ids, positions = (x[rows] for x in self.rows)
        for prompt in prompt_ids.unique().tolist():
            mine = (prompt_ids == prompt).nonzero().flatten()
            row = int(mine[margin[mine].argmin()])
            entry = self.best.setdefault(prompt, [float("inf"), -1, -1, False])
            if float(margin[row]) < entry[0]:
                entry[:3] = [float(margin[row]), layer, int(positions[row])]
            entry[3] = entry[3] or bool(tie[mine].any())


class RoutingMargins(_Margins):
    """Each router row's margin: the k-th largest minus the (k+1)-th router logit; a
    near-tie below near_tie x max(1, |k-th logit|)."""

    def __init__(self, model: torch.nn.Module, near_tie: float) -> None:
        super().__init__(model, near_tie, SoftmaxTopKRouter)

    @property
    def routers(self) -> int:
        return self.modules

    def measure(self, layer: int, module: torch.nn.Module, inputs: tuple) -> None:
        logits = F.linear(inputs[0], module.weight).float()  # as the router has them
        top = logits.topk(module.top_k + 1, dim=-1).values.cpu()
        margin = top[:, -2] - top[:, -1]
        tie = margin <= self.near_tie * top[:, -2].abs().clamp(min=1.0)
        self.record(layer, torch.arange(len(margin)), margin, tie)


class IndexerMargins(_Margins):
    """DeepSeek-V4's lightning indexer (float32 picks, `ReferenceTopK`): each query row's
    margin at its top-k cut, the k-th minus the (k+1)-th best visible score of its row; a
    near-tie below near_tie x max(1, |k-th score|). Scores exactly tied at 0 (every head's
    q.k <= 0) are no near-tie: the reference's own top-k decides them, and cpmoe takes it
    (`indexer.topk_as_reference`) -- unless another layout computes one of them
    as a tiny non-zero, which this cannot see. A row with no more visible entries than k
    has no cut (margin inf)."""

    def __init__(self, model: torch.nn.Module, near_tie: float) -> None:
        super().__init__(model, near_tie, ReferenceTopK)

    def measure(self, layer: int, module: torch.nn.Module, inputs: tuple) -> None:
        scores, first, length, k, rows = inputs
        cols = torch.arange(scores.shape[1], device=scores.device)
        inside = (cols >= first[:, None]) & (cols < (first + length)[:, None])
        top = scores.masked_fill(~inside, float("-inf")).sort(dim=-1, descending=True).values
        cut = torch.minimum(length, torch.tensor(k)).clamp(min=1)[:, None]
        if top.shape[1] == 0:
            return
        kth = top.gather(1, cut - 1).squeeze(1)
        nxt = torch.where(cut < top.shape[1], top.gather(1, cut.clamp(max=top.shape[1] - 1)),
                          float("-inf")).squeeze(1)
        has_cut = (nxt > float("-inf")) & (length > k)
        zero_tie = (kth == 0) & (nxt == 0)
        margin = torch.where(has_cut & ~zero_tie, kth - nxt, float("inf")).cpu()
        tie = margin <= self.near_tie * kth.abs().clamp(min=1.0).cpu()
        self.record(layer, rows.cpu(), margin, tie)


def _feed(seed: int, prompt: int, steps: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + prompt)
    return torch.randint(0, vocab, (steps,), generator=gen).tolist()


def _run(runner: ModelRunner, seqs: list[list[int]], feeds: list[list[int]], kv_dtype: str,
         margins: tuple[_Margins, ...] = (), index: int = 0
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill logits of every position, then one decode step per fed token, over a KV cache
    of --kv-cache-dtype `kv_dtype`. Each of `margins` has its rows named for each forward
    (prompts numbered from `index`)."""
    steps = len(feeds[0])
    # every token of the batch on every rank: enough whatever the model's cache rule (Qwen
    # shards K/V over CP, DeepSeek-V4 keeps its caches whole on every CP rank)
    runner.allocate_kv(kv_slots_needed([len(s) for s in seqs], steps + 1, 1,
                                       runner.layout.cp_strategy), kv_dtype=kv_dtype)
    keys = list(range(len(seqs)))

    def name_rows(rows: list[tuple[int, int]] | None) -> None:
        for m in margins:
            m.name_rows(rows)

    name_rows([(index + i, p) for i, s in enumerate(seqs) for p in range(len(s))])
    prefill = runner.extend([Segment(k, s) for k, s in zip(keys, seqs)], last_only=False)
    decode = []
    for k in range(steps):
        name_rows([(index + i, len(s) + k) for i, s in enumerate(seqs)])
        decode.append(runner.decode(keys, [f[k] for f in feeds]))
    name_rows(None)
    runner.kv = None
    return prefill, decode


def check_task(info: RankInfo, spec: RunSpec, batches: list[list[list[int]]],
               decode_steps: int, seed: int, near_tie: float | None,
               reference_kv_dtype: str | None = None) -> CheckReport | None:
    """Run every batch on the layout, then, on rank 0, on a one-rank reference; compare. The
    reference's K/V pools are of `reference_kv_dtype` (default: the layout's). The layout's
    outputs wait in host memory and its runner is freed before the reference is built: rank
    0 never holds two models (two 30B models, or one built in 16 bits to be quantized at
    load beside another, do not fit one 80 GB GPU)."""
    runner = build_runner(info, spec)
    vocab = runner.config.vocab_size
    feeds, outputs, index = [], [], 0
    for seqs in batches:
        t0 = time.perf_counter()
        feeds.append([_feed(seed, index + i, decode_steps, vocab) for i in range(len(seqs))])
        got, got_steps = _run(runner, seqs, feeds[-1], spec.options.kv_cache_dtype)
        if info.rank == 0:
            outputs.append((got.cpu(), [g.cpu() for g in got_steps], time.perf_counter() - t0))
        del got, got_steps
        index += len(seqs)
    del runner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if info.rank != 0:
        return None
    tie = NEAR_TIE_DEFAULT.get(spec.dtype, 2.0**-8) if near_tie is None else near_tie
    reference = ModelRunner(spec.model_dir, ProcessGroups.single(info.device), spec.dtype,
                            show_progress=False, load_format=spec.options.load_format,
                            quantization=spec.options.quantization)
    margins = (RoutingMargins(reference.model, tie), IndexerMargins(reference.model, tie))
    report = CheckReport(decode_steps, tie, strict_decode=spec.dtype == torch.float32)
    index, total = 0, sum(map(len, batches))
    for b, (seqs, fed, (got, got_steps, layout_s)) in enumerate(zip(batches, feeds, outputs)):
        t1 = time.perf_counter()
        want, want_steps = _run(reference, seqs, fed,
                                reference_kv_dtype or spec.options.kv_cache_dtype, margins, index)
        _compare(report, seqs, got.to(want.device), want,
                 [g.to(want.device) for g in got_steps], want_steps, *margins, index)
        done = report.prompts[-len(seqs):]
        indexer = (f", indexer near-ties {sum(p.index_near_tie for p in done)}"
                   if margins[1].modules else "")
        print(f"[check] batch {b + 1}/{len(batches)}: prompts {index + len(seqs)}/{total} "
              f"({sum(map(len, seqs))} tokens): layout {layout_s:.1f} s, reference "
              f"{time.perf_counter() - t1:.1f} s; first tokens "
              f"{sum(p.first_token_match for p in done)}/{len(done)}, routing near-ties "
              f"{sum(p.near_tie for p in done)}{indexer}", file=sys.stderr, flush=True)
        index += len(seqs)
    return report


def _compare(report: CheckReport, seqs, got, want, got_steps, want_steps,
             margins: RoutingMargins, indexer: IndexerMargins | None, index: int) -> None:
    start = 0
    for i, seq in enumerate(seqs):
        g, w = got[start:start + len(seq)], want[start:start + len(seq)]
        start += len(seq)
        top = int(w[-1].argmax())
        p = PromptReport(len(seq), int(g[-1].argmax()) == top)
        p.logprob_delta = abs(float(torch.log_softmax(g[-1], -1)[top]
                                    - torch.log_softmax(w[-1], -1)[top]))
        p.max_abs_diff = float((g - w).abs().max())
        for gs, ws in zip(got_steps, want_steps):
            p.decode_max_abs_diff = max(p.decode_max_abs_diff,
                                        float((gs[i] - ws[i]).abs().max()))
            p.decode_top1_mismatches += int(gs[i].argmax() != ws[i].argmax())
        best = margins.best.get(index + i) if margins.routers else None
        if best is not None:
            p.margin, p.margin_at, p.near_tie = best[0], (best[1], best[2]), best[3]
        best = indexer.best.get(index + i) if indexer is not None and indexer.modules else None
        if best is not None:
            p.index_margin, p.index_margin_at, p.index_near_tie = (best[0], (best[1], best[2]),
                                                                   best[3])
        report.prompts.append(p)
