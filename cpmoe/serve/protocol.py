"""The OpenAI-compatible request schema, its validation into `Job`s, and response bodies.

Validation: a malformed body, a known field of the wrong type, an empty prompt or an
out-of-range value is an `ApiError` (HTTP 400 with an OpenAI-style error body naming the
field), raised before anything reaches the engine. Unknown fields are ignored with a logged
warning (as vLLM does). Fields the API defines but cpmoe does not implement (tools, JSON
beam search, ...) are accepted at their no-op value only (`_NO_OPS`), otherwise refused
with a 400 naming the field and the value. Structured output and tools: structured.py.

A request becomes one `Job` per choice: every prompt of a completions request, `n` choices
each; choice i samples from stream i of the seed.

Defaults follow the OpenAI API: temperature 1, top_p 1, completions max_tokens 16. Without a
`seed` a random one is drawn, so a request is reproducible exactly when it names its seed.
Extensions (as in vLLM): `top_k` (0 or -1: no limit), `return_token_ids` (the choice then
carries `token_ids`, the generated ids including a final EOS), `ignore_eos` (generate
max_tokens tokens whatever comes; a grammar still ends the answer when it is complete),
`min_p`, and `stop_token_ids` (tokens that end the answer as EOS does: finish "stop", the
token in `token_ids` but not in the text, as SGLang trims it; impossible before
min_tokens). `logit_bias` (OpenAI): token id (a string) -> a bias in [-100, 100] added to
its logit. Completions `echo` with `logprobs`: the prompt's tokens come first in the
logprobs, each with its log-probability given the tokens before it (the first: null).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cpmoe.context import over_context
from cpmoe.cp.kv_cache import DEFAULT_PAGE_SIZE, kv_slots_needed, over_capacity
from cpmoe.engine.grammar import GrammarSpec
from cpmoe.engine.sampling import SamplingParams
from cpmoe.serve.structured import (NamedToolChoice, RequestError, ResponseFormat, Structure,
                                    Tool, structure)

SEED_LIMIT = 1 << 63  # seeds are non-negative 64-bit integers
MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per prompt (n, best_of)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit for chat)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
log = logging.getLogger("cpmoe.serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None,
                code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


# ---- request schema ---------------------------------------------------------------------------

class _Strict(BaseModel):
    # Unknown fields are kept aside (`model_extra`) and ignored with a logged warning, as vLLM
    # does; known fields are typed strictly.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(_Strict):
    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang's structured-output fields
    ebnf: str | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool | None = None
    # known, accepted only at the value that changes nothing (see _NO_OPS)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    # accepted, nothing to do: the server stores nothing and has no tiers
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class ProfileRequest(BaseModel):
    """POST /start_profile (SGLang's fields). Unknown fields are refused: a misspelt one
    would silently profile something other than what was asked."""
    model_config = ConfigDict(extra="forbid", strict=True)
    output_dir: str | None = None  # None: $CPMOE_TORCH_PROFILER_DIR, else /tmp/cpmoe-profile
    num_steps: int | None = Field(None, ge=1)  # None: until /stop_profile
    activities: list[Literal["CPU", "GPU"]] | None = Field(None, min_length=1)  # None: both
    record_shapes: bool = False
    with_stack: bool = False


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: only for an assistant message
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (to the template)
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    echo: bool | None = None
    chat_template: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None


# A known field cpmoe does not implement: accepted at the values listed (its no-op), else a
# 400 naming the field and the value.
_NO_OPS: dict[str, tuple[object, ...]] = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,),
    "use_beam_search": (False,), "length_penalty": (1.0, 1),
    "suffix": ("",), "chat_template": (), "reasoning_effort": (), "modalities": (["text"],),
    "prompt_logprobs": (), "continuous_usage_stats": (False,),
}


def _refuse_unsupported(req: _Common) -> None:
    values = {name: getattr(req, name, None) for name in _NO_OPS}
    if req.stream_options is not None:
        values["continuous_usage_stats"] = req.stream_options.continuous_usage_stats
    for name, value in values.items():
        if value is not None and value not in _NO_OPS[name]:
            where = "stream_options." + name if name == "continuous_usage_stats" else name
            raise bad_request(f"{where}={value!r} is not supported by cpmoe"
                              + (f" (only {', '.join(map(repr, _NO_OPS[name]))})"
                                 if _NO_OPS[name] else ""), where, "unsupported_value")
    if isinstance(req, ChatRequest):
        if req.echo:
            raise bad_request("echo=True is not supported for chat", "echo",
                              "unsupported_value")
        for i, m in enumerate(req.messages):
            if m.content is None and m.role != "assistant":
                raise bad_request(f"messages[{i}].content: null is allowed only for an "
                                  f"assistant message", "messages")
            if m.tool_calls and m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only an assistant message "
                                  f"makes tool calls", "messages")


def ignored_fields(req: _Common) -> list[str]:
    """Names of the unknown fields in a request (top level and stream_options / messages)."""
    names = list(req.model_extra or {})
    if req.stream_options is not None:
        names += [f"stream_options.{k}" for k in req.stream_options.model_extra or {}]
    for i, m in enumerate(getattr(req, "messages", [])):
        names += [f"messages[{i}].{k}" for k in m.model_extra or {}]
    return names


_EXPECTED = {"prompt": "a string, a list of token ids, or a list of either",
             "stop": "a string or a list of strings",
             "messages": "a list of {role, content} objects with text content"}


def parse_body(raw: bytes, schema: type[BaseModel]) -> Any:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _from_validation(e) from None


def _from_validation(e: ValidationError) -> ApiError:
    errors = e.errors()
    first = errors[0]
    param = str(first["loc"][0]) if first["loc"] else None
    if param in _EXPECTED and (len(errors) > 1 or len(first["loc"]) > 1):
        return bad_request(f"{param}: expected {_EXPECTED[param]}", param, "invalid_type")
    where = ".".join(str(p) for p in first["loc"])
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    got = "" if first["type"] == "missing" else f" (got {shown})"
    return bad_request(f"{where}: {first['msg']}{got}", param, code)


# ---- request -> job -------------------------------------------------------------------------

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


def make_job(req: _Common, prompt_ids: list[int], default_max_tokens: int,
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


def _check_common(req: _Common, tokenizer, limits: Limits) -> Structure:
    """-> the request's grammar and tool use (structured.py)."""
    _refuse_unsupported(req)
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


def warn_ignored(req: _Common, endpoint: str) -> None:
    names = ignored_fields(req)
    if names:
        log.warning("%s: ignoring unknown field(s) %s", endpoint, ", ".join(names))


# ---- responses ----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache held (exact to
    the token, at most all but the last prompt token)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(text: str, finish: str | None, token_ids: list[int] | None = None,
                      index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
    return _choice({"text": text}, finish, token_ids, index, logprobs)


def chat_choice(message: dict[str, Any], finish: str | None,
                token_ids: list[int] | None = None, index: int = 0,
                logprobs: dict | None = None) -> dict[str, Any]:
    """`message`: the assistant message (role, content, maybe reasoning_content and
    tool_calls)."""
    return _choice({"message": message}, finish, token_ids, index, logprobs)


def chat_delta(delta: dict[str, str], finish: str | None, token_ids: list[int] | None = None,
               index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
    return _choice({"delta": delta}, finish, token_ids, index, logprobs)


def _choice(body: dict[str, Any], finish: str | None, token_ids: list[int] | None,
            index: int, logprobs: dict | None) -> dict[str, Any]:
    """One choice of a response or chunk; `token_ids` only when the request asked for them."""
    choice: dict[str, Any] = {"index": index, **body, "logprobs": logprobs,
                              "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice
