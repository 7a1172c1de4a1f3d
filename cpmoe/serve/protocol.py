"""The OpenAI-compatible request schema and its validation (a request's `Job`s: jobs.py; the
response bodies: responses.py).

Validation: a malformed body, a known field of the wrong type, an empty prompt or an
out-of-range value is an `ApiError` (HTTP 400 with an OpenAI-style error body naming the
field), raised before anything reaches the engine. Unknown fields are ignored with a logged
warning (as vLLM does). Fields the API defines but cpmoe does not implement (tools, JSON
beam search, ...) are accepted at their no-op value only (`_NO_OPS`), otherwise refused
with a 400 naming the field and the value. Structured output and tools: structured.py.


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

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cpmoe.serve.structured import NamedToolChoice, ResponseFormat, Tool

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


class RequestBase(_Strict):
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


class CompletionRequest(RequestBase):
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


class ChatRequest(RequestBase):
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


def refuse_unsupported(req: RequestBase) -> None:
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


def ignored_fields(req: RequestBase) -> list[str]:
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
