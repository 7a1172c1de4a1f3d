"""The OpenAI-compatible request schema, its validation into a `Job`, and response bodies.

Validation is strict: a malformed body, a field of the wrong type, an unknown field, an empty
prompt or an out-of-range value is an `ApiError` (HTTP 400 with an OpenAI-style error body),
raised before anything reaches the engine. Fields the API defines but this server does not
implement are accepted only at their no-op value (n=1, echo=false, penalties 0, ...).

Defaults follow the OpenAI API: temperature 1, top_p 1, completions max_tokens 16. Without a
`seed` a random one is drawn, so a request is reproducible exactly when it names its seed.
Extensions (as in vLLM): `top_k` (0 or -1: no limit), `return_token_ids` (the choice then
carries `token_ids`, the generated ids including a final EOS) and `ignore_eos` (generate
max_tokens tokens whatever comes).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cpmoe.context import over_context
from cpmoe.engine.generate import kv_slots_needed
from cpmoe.engine.sampling import SamplingParams

SEED_LIMIT = 1 << 63  # seeds are non-negative 64-bit integers
MAX_STOP_STRINGS = 16


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
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


_EXPECTED = {"prompt": "a string, a list of token ids, or a one-element list of either",
             "stop": "a string or a list of strings",
             "messages": "a list of {role, content} objects with text content"}


def parse_body(raw: bytes, schema: type[_Common]) -> Any:
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
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown parameter {param!r}", param, "unknown_parameter")
    if param in _EXPECTED and (len(errors) > 1 or len(first["loc"]) > 1):
        return bad_request(f"{param}: expected {_EXPECTED[param]}", param, "invalid_type")
    where = ".".join(str(p) for p in first["loc"])
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    return bad_request(f"{where}: {first['msg']}", param, code)


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
    page_size: int = 16
    chunked_prefill_size: int = 0


@dataclass(frozen=True)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    kv_need: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    ignore_eos: bool


def _unsupported(req: _Common, extra: dict[str, tuple[object, object]]) -> None:
    checks = {"n": (req.n, 1), "presence_penalty": (req.presence_penalty, 0.0),
              "frequency_penalty": (req.frequency_penalty, 0.0), **extra}
    for name, (value, allowed) in checks.items():
        if value is not None and value != allowed:
            raise bad_request(f"{name}={value!r} is not supported (only {allowed!r})", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} strings", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop: empty stop string", "stop")
    return tuple(stops)


def completion_prompt(req: CompletionRequest, tokenizer, vocab_size: int) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(f"prompt: got {len(prompt)} prompts; one per request is "
                              f"supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt: empty prompt", "prompt")
        return tokenizer.encode(prompt)  # as `cpmoe generate --prompt` does
    if not prompt:
        raise bad_request("prompt: empty prompt", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"prompt: token id {bad[0]} outside [0, {vocab_size})", "prompt")
    return list(prompt)


def chat_prompt(req: ChatRequest, tokenizer) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content)} for m in req.messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)  # the template placed any BOS


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
    if need > limits.kv_capacity:
        raise bad_request(f"the request needs {need} KV slots on the busiest CP rank (prompt of "
                          f"{len(prompt_ids)} tokens, max_tokens {max_tokens}); the server has "
                          f"{limits.kv_capacity} per rank (--max-total-tokens)", "max_tokens",
                          "context_length_exceeded")
    top_k = req.top_k if req.top_k and req.top_k > 0 else 0
    seed = req.seed if req.seed is not None else random.randrange(SEED_LIMIT)
    params = SamplingParams(1.0 if req.temperature is None else req.temperature,
                            1.0 if req.top_p is None else req.top_p, top_k, seed)
    return Job(prompt_ids, params, max_tokens, need, _stops(req.stop), bool(req.stream),
               bool(req.stream_options and req.stream_options.include_usage),
               bool(req.return_token_ids), bool(req.ignore_eos))


def completion_job(req: CompletionRequest, tokenizer, limits: Limits) -> Job:
    _unsupported(req, {"echo": (req.echo, False), "logprobs": (req.logprobs, None),
                       "best_of": (req.best_of, 1), "suffix": (req.suffix, None)})
    return make_job(req, completion_prompt(req, tokenizer, limits.vocab_size), 16, limits)


def chat_job(req: ChatRequest, tokenizer, limits: Limits) -> Job:
    _unsupported(req, {"logprobs": (req.logprobs, False),
                       "top_logprobs": (req.top_logprobs, None)})
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
    return make_job(req, chat_prompt(req, tokenizer), limits.default_chat_max_tokens, limits)


# ---- responses ----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(text: str, finish: str | None, token_ids: list[int] | None = None
                      ) -> dict[str, Any]:
    return _choice({"text": text}, finish, token_ids)


def chat_choice(text: str, finish: str | None, token_ids: list[int] | None = None
                ) -> dict[str, Any]:
    return _choice({"message": {"role": "assistant", "content": text}}, finish, token_ids)


def chat_delta(delta: dict[str, str], finish: str | None, token_ids: list[int] | None = None
               ) -> dict[str, Any]:
    return _choice({"delta": delta}, finish, token_ids)


def _choice(body: dict[str, Any], finish: str | None, token_ids: list[int] | None
            ) -> dict[str, Any]:
    """One choice of a response or chunk; `token_ids` only when the request asked for them."""
    choice: dict[str, Any] = {"index": 0, **body, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice
