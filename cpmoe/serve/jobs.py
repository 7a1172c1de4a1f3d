"""A validated request (protocol.py) becomes one `Job` per choice: every prompt of a
completions request, `n` choices each; choice i samples from stream i of the seed. The
prompt is tokenized here (chat template, tools), checked against the context length and the
KV capacity (`Limits`), and the sampling fields become `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from typing import Any

from cpmoe.context import over_context
from cpmoe.cp.kv_capacity import DEFAULT_PAGE_SIZE, kv_slots_needed, over_capacity
from cpmoe.engine.grammar import GrammarSpec
from cpmoe.engine.sampling import SamplingParams
from cpmoe.serve.protocol import (MAX_LOGIT_BIAS, MAX_PROMPTS, MAX_STOP_STRINGS, SEED_LIMIT,
                                  ApiError, ChatMessage, ChatRequest, CompletionRequest,
                                  RequestBase, bad_request, ignored_fields, refuse_unsupported)
from cpmoe.serve.structured import RequestError, Structure, structure

log = logging.getLogger("cpmoe.serve")

@dataclass(frozen=True)
class Limits:
    """What the served model and engine accept."""

    model_name: str
    vocab_size: int
    context_length: int  # prompt + max_tokens at most (cpmoe/context.py)
    kv_capacity: int
    cp_size: int
    cp_strategy: str
    default_chat_max_tokens: int
    page_size: int = DEFAULT_PAGE_SIZE
    chunked_prefill_size: int = 0
    tool_call_parser: str | None = None  # --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser


@dataclass(frozen=True)
class Job:
    """One choice of a request: one engine request. Choice `index` samples from stream
    `index` of the seed, so choice i of prompt 0 equals prompt i of `cpmoe generate`."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    kv_need: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    ignore_eos: bool
    index: int = 0  # choice index in the response (prompt p, choice i: p * n + i)
    first_of_prompt: bool = True  # counts the prompt in usage (once per prompt)
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k
    echo: str | None = None  # completions echo: the prompt text put before the output
    n: int = 1  # choices per prompt the client asked for
    best_of: int = 1  # > 1: one of best_of candidates of its prompt (the best n are kept)
    show_logprobs: bool = True  # False: logprobs taken only to rank best_of candidates
    grammar: GrammarSpec | None = None  # structured output (structured.py)
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: bool = False  # completions echo + logprobs: the prompt's come first
    reasoning: bool = False  # chat: split reasoning_content off (--reasoning-parser)
    tool_calls: bool = False  # chat: parse the answer for tool calls (--tool-call-parser)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} strings", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop: empty stop string", "stop")
    return tuple(stops)


def _no_tokenizer(what: str, param: str) -> ApiError:
    return bad_request(f"{what} needs a tokenizer; this server runs with "
                       f"--skip-tokenizer-init (send token ids)", param, "unsupported_value")


def completion_prompts(req: CompletionRequest, tokenizer, vocab_size: int
                       ) -> list[tuple[list[int], str | None]]:
    """-> (token ids, text or None) of every prompt of the request."""
    prompt = req.prompt
    many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    prompts = list(prompt) if many else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"prompt: {len(prompts)} prompts; at most {MAX_PROMPTS} per request",
                          "prompt")
    out = []
    for i, p in enumerate(prompts):
        where = f"prompt[{i}]" if many else "prompt"
        if not p:
            raise bad_request(f"{where}: empty prompt", "prompt")
        if isinstance(p, str):
            if tokenizer is None:
                raise _no_tokenizer("a text prompt", "prompt")
            out.append((tokenizer.encode(p), p))  # as `cpmoe generate --prompt` does
            continue
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"{where}: token id {bad[0]} outside [0, {vocab_size})", "prompt")
        out.append((list(p), None))
    return out


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (text content; calls and call ids as given)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content if isinstance(m.content, str)
                           else "".join(p.text for p in m.content or [])}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def chat_prompt(req: ChatRequest, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """`tools`: given to the template (it renders them as the model expects)."""
    if tokenizer is None:
        raise _no_tokenizer("chat", "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    messages = [_message(m) for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    kwargs.setdefault("add_generation_prompt", req.add_generation_prompt is not False)
    if req.continue_final_message:
        kwargs.update(continue_final_message=True, add_generation_prompt=False)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001  (a template's error is the request's fault)
        raise bad_request(f"chat template failed on these messages / chat_template_kwargs: "
                          f"{e}", "chat_template_kwargs" if req.chat_template_kwargs
                          else "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template placed any BOS


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: {len(bias)} tokens; at most {MAX_LOGIT_BIAS}",
                          "logit_bias")
    out = []
    for key, value in bias.items():
        token = int(key) if key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias: key {key!r} is not a token id in [0, "
                              f"{vocab_size})", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias[{key!r}]={value}: expected a bias in [-100, 100]",
                              "logit_bias")
        out.append((token, float(value)))
    return tuple(sorted(out))


def _stop_token_ids(ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    bad = [t for t in ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids: token id {bad[0]} outside [0, {vocab_size})",
                          "stop_token_ids")
    return tuple(sorted(set(ids or [])))


def make_job(req: RequestBase, prompt_ids: list[int], default_max_tokens: int,
             limits: Limits) -> Job:
    max_tokens = req.max_tokens or getattr(req, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = default_max_tokens
    refusal = over_context(len(prompt_ids), max_tokens, limits.context_length)
    if refusal:
        raise bad_request(refusal, "max_tokens", "context_length_exceeded")
    need = kv_slots_needed([len(prompt_ids)], max_tokens, limits.cp_size, limits.cp_strategy,
                           limits.page_size, limits.chunked_prefill_size)
    refusal = over_capacity(len(prompt_ids), max_tokens, need, limits.kv_capacity)
    if refusal:
        raise bad_request(refusal, "max_tokens", "context_length_exceeded")
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens={req.min_tokens} is more than max_tokens {max_tokens}",
                          "min_tokens")
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    seed = req.seed if req.seed is not None else random.randrange(SEED_LIMIT)
    params = SamplingParams(1.0 if req.temperature is None else req.temperature,
                            1.0 if req.top_p is None else req.top_p, top_k, seed,
                            req.presence_penalty or 0.0, req.frequency_penalty or 0.0,
                            1.0 if req.repetition_penalty is None else req.repetition_penalty,
                            req.min_tokens or 0, _logit_bias(req.logit_bias, limits.vocab_size),
                            req.min_p or 0.0)
    return Job(prompt_ids, params, max_tokens, need, _stops(req.stop), bool(req.stream),
               bool(req.stream_options and req.stream_options.include_usage),
               bool(req.return_token_ids), bool(req.ignore_eos),
               stop_token_ids=_stop_token_ids(req.stop_token_ids, limits.vocab_size))


def _choices(job: Job, n: int, first: int, logprobs: int | None, echo: str | None,
             best_of: int = 1) -> list[Job]:
    """n choices of one prompt; with best_of > n, best_of candidates that carry logprobs
    (to rank them) whether or not the client asked for them."""
    if best_of <= n:
        return [dataclasses.replace(job, index=first + i, first_of_prompt=i == 0, n=n,
                                    logprobs=logprobs, echo=echo) for i in range(n)]
    return [dataclasses.replace(job, index=first + i, first_of_prompt=i == 0, n=n,
                                logprobs=logprobs or 0, echo=echo, best_of=best_of,
                                show_logprobs=logprobs is not None) for i in range(best_of)]


def _check_common(req: RequestBase, tokenizer, limits: Limits) -> Structure:
    """-> the request's grammar and tool use (structured.py)."""
    refuse_unsupported(req)
    if tokenizer is None and req.stop:
        raise _no_tokenizer("stop", "stop")
    chat = isinstance(req, ChatRequest)
    try:
        found = structure(req.response_format, req.regex, req.ebnf,
                          req.tools if chat else None, req.tool_choice if chat else None,
                          req.parallel_tool_calls if chat else None, limits.tool_call_parser)
    except RequestError as e:
        raise bad_request(str(e), e.param) from None
    if found.grammar is not None and tokenizer is None:
        raise _no_tokenizer("structured output", "response_format")
    return found


def completion_jobs(req: CompletionRequest, tokenizer, limits: Limits) -> list[Job]:
    """-> one Job per choice: every prompt in order, n choices each."""
    found = _check_common(req, tokenizer, limits)
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise bad_request(f"best_of={best_of} is less than n={n}", "best_of")
    if best_of > n and req.stream:
        raise bad_request(f"best_of={best_of} > n={n} cannot stream (as OpenAI)", "best_of")
    if req.echo and tokenizer is None:
        raise _no_tokenizer("echo", "echo")
    if req.logprobs is not None and tokenizer is None:
        raise _no_tokenizer("logprobs", "logprobs")
    jobs = []
    for ids, text in completion_prompts(req, tokenizer, limits.vocab_size):
        echo = None
        if req.echo:
            echo = text if text is not None else tokenizer.decode(ids)
        job = dataclasses.replace(make_job(req, ids, 16, limits), grammar=found.grammar,
                                  prompt_logprobs=bool(req.echo) and req.logprobs is not None)
        jobs += _choices(job, n, len(jobs), req.logprobs, echo, best_of)
    return jobs


def chat_jobs(req: ChatRequest, tokenizer, limits: Limits) -> list[Job]:
    """-> one Job per choice (n of them)."""
    found = _check_common(req, tokenizer, limits)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
    if req.top_logprobs and not req.logprobs:
        raise bad_request(f"top_logprobs={req.top_logprobs} needs logprobs=true",
                          "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    job = make_job(req, chat_prompt(req, tokenizer, found.template_tools),
                   limits.default_chat_max_tokens, limits)
    job = dataclasses.replace(job, grammar=found.grammar, tool_calls=found.tool_calls,
                              reasoning=limits.reasoning_parser is not None)
    return _choices(job, req.n or 1, 0, logprobs, None)


def warn_ignored(req: RequestBase, endpoint: str) -> None:
    names = ignored_fields(req)
    if names:
        log.warning("%s: ignoring unknown field(s) %s", endpoint, ", ".join(names))


