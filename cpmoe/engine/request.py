"""The scheduler's records: a `Request` (its prompt, sampling, grammar and progress), a
step's `StepPlan` (what every rank runs next) and the `TokenEvent` a request's frontend gets
for each token. Plain data, read by the engine, the runner and the frontends."""

from __future__ import annotations

from dataclasses import dataclass, field

from cpmoe.engine.grammar import GrammarSpec
from cpmoe.engine.profiler import ProfileCommand
from cpmoe.engine.sampling import SamplingParams


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stream: int = 0  # sampling stream: the prompt index of a generate batch, 0 when served
    ignore_eos: bool = False  # run to max_tokens (load tests, benchmarks)
    kv_need: int = 0  # KV slots on the busiest CP rank at its longest (reported, not used)
    logprobs: int | None = None  # None: none; k: the token's log-probability and the top k
    stop_ids: tuple[int, ...] = ()  # tokens that end it as EOS does (`stop_token_ids`)
    grammar: GrammarSpec | None = None  # what its output must match (engine/grammar.py)
    prompt_logprobs: int | None = None  # k: each prompt token's log-probability and top k
    output: list[int] = field(default_factory=list)
    cached: int = 0  # tokens of prompt + output held in the KV cache
    cached_prompt: int = 0  # prompt tokens taken from the prefix cache at admission
    admitted: int = 0  # admission order (preemption takes the newest)
    done: bool = False  # finished or cancelled: rows still in flight for it are dropped
    # rank 0's per-request state: the grammar's matcher (the driver sets it on arrival) and
    # the prompt log-probabilities so far (entry i: prompt token i + 1)
    matcher: object = field(default=None, repr=False, compare=False)
    prompt_lps: list = field(default_factory=list, repr=False, compare=False)

    @property
    def ends_on_eos(self) -> bool:
        """EOS ends it: unless ignore_eos, and always under a grammar (a complete grammar
        allows only EOS)."""
        return not self.ignore_eos or self.grammar is not None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (1 while decoding: the last sampled token)."""
        return len(self.prompt) + len(self.output) - self.cached

    @property
    def prefilling(self) -> bool:
        """Tokens before the last sampled one are still to be cached (a prompt chunked so
        that one prompt token is left still extends)."""
        return self.pending > 1 or self.cached < len(self.prompt)

    @property
    def decoding(self) -> bool:
        """Only the last sampled token is pending, and it is not the last one the request
        may generate (then it is in flight, see `Scheduler.account`)."""
        return not self.prefilling and self.generated < self.max_tokens

    @property
    def generated(self) -> int:
        return len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1]


@dataclass(frozen=True)
class StepPlan:
    """What every rank does in one step; built on rank 0 and broadcast to all ranks."""

    free: list[int] = field(default_factory=list)  # request ids whose KV to free first
    fork: list[tuple[int, int, int]] = field(default_factory=list)  # (id, source, tokens)
    cache: list[int] = field(default_factory=list)  # ids whose KV stays as a cached prefix
    extend: list[tuple[int, list[int], int]] = field(default_factory=list)  # (id, ids, start)
    # per extend segment, its request's tokens when all pending ones are cached (a chunk's
    # whole prompt: V4's indexer ranks over the whole prompt's entries, whatever the chunks)
    extend_ends: list[int] = field(default_factory=list)
    # (id, token to feed); a token -(i + 1) is row i of the previous step's sampled tokens
    decode: list[tuple[int, int]] = field(default_factory=list)
    overlap: bool = False  # the step's tokens stay on the device for the next step's feed
    samples: int = 0  # with overlap: how many rows it samples (the shared tensor's length)
    # ids of extend segments whose every row's logits rank 0 needs (prompt logprobs)
    prompt_logits: list[int] = field(default_factory=list)
    stop: bool = False  # leave the engine loop
    result: object = None  # with stop: what the loop returns on every rank
    profile: ProfileCommand | None = None  # open or close a profiler window before the step

    @property
    def empty(self) -> bool:
        return not (self.free or self.cache or self.fork or self.extend or self.decode)

    @property
    def kind(self) -> str:
        return ("mixed" if self.decode and self.extend else "decode" if self.decode else
                "prefill" if self.extend else "idle")

    @property
    def cached_tokens(self) -> int:
        """Tokens this step takes from the prefix cache instead of prefilling them."""
        return sum(n for _, _, n in self.fork)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of a request; `finish` is "stop" (EOS or a stop token id), "length"
    or None. With `Request.logprobs`: the token's log-probability and the top (token,
    logprob). With `Request.prompt_logprobs`, the request's first event carries (logprob,
    top) of every prompt token after the first."""

    rid: int
    token: int
    finish: str | None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    cached_tokens: int | None = None  # with finish: prompt tokens the prefix cache gave
    prompt_logprobs: tuple[tuple[float, tuple], ...] | None = None
