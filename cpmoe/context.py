"""The context length: how many positions one sequence (prompt + generated tokens) may span.

It is the model's `max_position_embeddings` (config.json), which SGLang's `--context-length`
may lower. A longer override is refused: positions past the model's are untrained, and the
decode CUDA graphs size their block tables for the model's context.

A request fits when prompt + max_tokens <= context length (the OpenAI API's rule: the last
generated token is counted although it is never fed back). The check is O(1); the CLI
turns its message into one line and exit 2, the server into an HTTP 400.
"""

from __future__ import annotations


def context_length(model_positions: int, flag: int | None) -> int:
    """The context length to enforce; ValueError (one line naming the flag) for a bad one."""
    if flag is None:
        return model_positions
    if flag < 1:
        raise ValueError(f"--context-length must be >= 1, got {flag}")
    if flag > model_positions:
        raise ValueError(f"--context-length {flag}: longer than the model's "
                         f"{model_positions} positions (max_position_embeddings in "
                         f"config.json); only a shorter one can be set")
    return flag


def over_context(prompt_tokens: int, max_tokens: int, context: int, what: str = "prompt",
                 max_flag: str = "max_tokens") -> str | None:
    """The refusal when prompt + max_tokens exceed the context length, else None
    (max_tokens 0: a prefill, the prompt alone)."""
    total = prompt_tokens + max_tokens
    if total <= context:
        return None
    if max_tokens == 0:
        return (f"{what} of {prompt_tokens} tokens exceeds the context length of {context} "
                f"tokens")
    return (f"{what} of {prompt_tokens} tokens + {max_flag} {max_tokens} = {total} tokens "
            f"exceeds the context length of {context} tokens")
