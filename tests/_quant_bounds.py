"""How far two runs that quantize may differ, and what of them must still be equal.

Two runs of one model on different layouts (or CPU kernels: AVX2 and AVX-512 sum float32
products in different orders) compute every activation with rounding differences of a few
float32 ulps. Where nothing is quantized those differences stay that size (the layout tests'
1e-5). Where a value is stored in FP8 (an `--kv-cache-dtype fp8_e4m3` page, an activation an
FP8 GEMM reads), a value whose float32 input sits next to the midpoint of two e4m3 codes can
round to the other code in one of the runs: a *flip*. That moves the stored value by one e4m3
step, up to 2^-3 of its magnitude (3 mantissa bits: neighbouring codes in [2^e, 2^(e+1)) are
2^(e-3) apart), no matter how small the float32 difference was. No CPU-tuned tolerance covers
that; this module derives the bound from the step instead.

`flip_bound(scale, flips, mixed)`: the logits' worst difference that `flips` flips explain.
    One flipped value is one coordinate of a vector of `mixed` values of comparable size (a
    token's K or V row: kv_heads * head_dim values) that the model only reads through dot
    products and norms (q.k over a head, o_proj over the heads, an RMSNorm before every
    projection and before the head). One coordinate of n comparable ones carries 1/sqrt(n)
    of the vector's norm, so one step of it changes the vector by 2^-3 / sqrt(n) of its
    norm; the normalized layers pass relative changes on with a gain of about one, so the
    logits move by at most about `scale` * 2^-3 / sqrt(mixed), `scale` their largest
    magnitude. Flips add at worst linearly: bound = floor + flips * scale * 2^-3 /
    sqrt(mixed), floor the float32 tolerance of the same comparison without quantization.
    Measured on the tiny Qwen3-MoE over FP8 K/V pages (scale 0.60, one-flip bound 1.3e-2):
    one code moved by one step at a random K/V position, in 24 runs, moved the logits by
    4e-5 to 1.3e-2 (its echo included: later layers re-quantize what it changed), so one
    flip sits at the bound's edge and a test allows a few (FP8_FLIPS in
    tests/distributed/test_decode.py says how many and why). Layout bugs are larger: one
    token's K/V row in one layer replaced by another token's (a page read from the wrong
    shard) moved them by 2e-2 to 0.28, one write's values doubled (a scale applied twice)
    by 0.09 to 0.17, and they change decisive tokens; a wrong row or a missing scale
    across a whole step is of the order of `scale` itself (tests/unit/test_quant_bounds.py
    and test_decode.py feed such inputs and see them fail).

`decisive_agreement(got, want, bound)`: the invariant part of two greedy runs. Every logit
    row within `bound`. Where the reference's top-1 logit leads its top-2 by more than
    2 * bound, logits within `bound` cannot swap them (each may move by `bound`), so the
    sampled tokens must be equal. At a step whose gap is not larger the token may
    legitimately differ; if it does, every later step of that sequence continues from
    another token and is not compared (the sequence is compared up to and including that
    step's logits); if it does not, the inputs are still the same and comparing goes on.
    Returns what was compared, so a test can check that it compared enough to mean
    something.

`rounding_flips(stored, exact, rel, atol)`: the invariant of the codes themselves. FP8 codes
    one implementation stored equal the rounding of the float32 values another computed for
    the same inputs, code for code, except where those values lie within
    rel * |value| + atol of a midpoint (the two implementations' float32 results differ by
    about that much, so either code is right); there the code must be the rounding of a
    value that close, i.e. the neighbouring code. Anything else raises. -> flips counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

E4M3_STEP = 2.0 ** -3  # one e4m3 code step relative to the value's power of two
FP32_TOL = 1e-5  # the layout tests' float32 tolerance (tests/distributed/test_layouts.py)


def flip_bound(scale: float, flips: int, mixed: int, step: float = E4M3_STEP,
               floor: float = FP32_TOL) -> float:
    """floor + flips * scale * step / sqrt(mixed) (the module docstring derives it)."""
    if scale <= 0 or flips < 0 or mixed < 1:
        raise ValueError(f"flip_bound needs scale > 0, flips >= 0, mixed >= 1; got scale "
                         f"{scale}, flips {flips}, mixed {mixed}")
    return floor + flips * scale * step / math.sqrt(mixed)


def logit_scale(steps: list[torch.Tensor]) -> float:
    """The largest logit magnitude over every step (`flip_bound`'s scale)."""
    return max(s.abs().max().item() for s in steps)


@dataclass
class StepRun:
    """One greedy run as a step observer saw it: `steps[j]` the logits [rows, V] of step j,
    `rows[j]` the sequence of each row, `tokens[i]` the tokens sequence i sampled in order."""

    steps: list[torch.Tensor]
    rows: list[list[int]]
    tokens: list[list[int]]


@dataclass
class Agreement:
    """What `decisive_agreement` compared: tokens that had to be equal and were, logit rows
    within the bound, and the sequences cut at a close call (sequence -> its step index)."""

    tokens: int = 0
    rows: int = 0
    worst: float = 0.0
    cut: dict[int, int] = field(default_factory=dict)


def decisive_agreement(got: StepRun, want: StepRun, bound: float) -> Agreement:
    """Raise AssertionError where `got` departs from `want` by more than quantization
    flips explain (the module docstring says what that is); -> what was compared."""
    if got.rows != want.rows:
        raise AssertionError(f"the runs sampled different rows per step: {got.rows} vs "
                             f"{want.rows}")
    seen: dict[int, int] = {}  # sequence -> tokens of it so far
    out = Agreement()
    for j, (g, w, rows) in enumerate(zip(got.steps, want.steps, want.rows, strict=True)):
        if g.shape != w.shape or g.shape[0] != len(rows):
            raise AssertionError(f"step {j}: logits {tuple(g.shape)} vs {tuple(w.shape)} for "
                                 f"{len(rows)} rows")
        top2 = w.float().topk(2, dim=-1).values
        for r, seq in enumerate(rows):
            k = seen.get(seq, 0)
            seen[seq] = k + 1
            if seq in out.cut:
                continue
            diff = (g[r].float() - w[r].float()).abs().max().item()
            if diff > bound:
                raise AssertionError(f"step {j}, sequence {seq} (token {k}): logits "
                                     f"{diff:.3e} apart, more than the bound {bound:.3e}")
            out.rows, out.worst = out.rows + 1, max(out.worst, diff)
            gap = (top2[r, 0] - top2[r, 1]).item()
            same = got.tokens[seq][k] == want.tokens[seq][k]
            if gap > 2 * bound and not same:
                raise AssertionError(f"step {j}, sequence {seq}: token {k} is "
                                     f"{got.tokens[seq][k]}, want {want.tokens[seq][k]} "
                                     f"(reference top-2 gap {gap:.3e} > 2 * bound "
                                     f"{bound:.3e})")
            if not same:  # a close call went the other way: the continuations differ
                out.cut[seq] = j
            elif gap > 2 * bound:
                out.tokens += 1
    return out


def rounding_flips(stored: torch.Tensor, exact: torch.Tensor, rel: float,
                   atol: float = 0.0) -> int:
    """Check `stored` (FP8 codes) against the rounding of `exact` (float32) as the module
    docstring says -> how many codes are the neighbouring one (flips)."""
    if stored.shape != exact.shape:
        raise AssertionError(f"stored codes {tuple(stored.shape)} vs values "
                             f"{tuple(exact.shape)}")
    top = torch.finfo(stored.dtype).max

    def rounded(x: torch.Tensor) -> torch.Tensor:  # saturating, as an FP8 K/V pool stores
        return x.float().clamp(-top, top).to(stored.dtype).float()

    exact = exact.float()
    slack = rel * exact.abs() + atol
    lo, hi, got = rounded(exact - slack), rounded(exact + slack), stored.float()
    bad = (got < lo) | (got > hi)
    if bad.any():
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} codes are not the rounding "
                             f"of their value within {rel:g} relative: e.g. "
                             f"{got.reshape(-1)[i].item()!r} stored for "
                             f"{exact.reshape(-1)[i].item()!r}")
    return int((got != rounded(exact)).sum())
