"""OpenAI response bodies: ids, timestamps, usage, and the choices of completions, chat and
chat stream chunks."""

from __future__ import annotations

import time
import uuid
from typing import Any


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
