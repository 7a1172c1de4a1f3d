"""Log-probabilities in the OpenAI response shapes, from the engine's `TokenEvent`s.

Tokens are named by their text, or "bytes:\\xNN..." (OpenAI's form) when a byte-level BPE
token holds only part of a UTF-8 character, so distinct tokens keep distinct names; the
chat shape also gives each token's own bytes.
"""

from __future__ import annotations

from typing import Any


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_decoder()


def token_bytes(tokenizer, token: int) -> bytes:
    """The token's own bytes (a byte-level BPE token may hold part of a character)."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    return tokenizer.decode([token]).encode()


def _piece(tokenizer, token: int) -> str:
    """The token as text, or "bytes:\\xNN..." (OpenAI's form) when its bytes are not
    whole UTF-8 characters, so that distinct tokens keep distinct names."""
    raw = token_bytes(tokenizer, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(tokenizer, events: list, offset: int) -> dict[str, Any]:
    """The legacy completions shape for these tokens (TokenEvents with logprobs); `offset`:
    characters of the choice's text before the first of them."""
    tokens = [_piece(tokenizer, ev.token) for ev in events]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [ev.logprob for ev in events],
            "top_logprobs": [{_piece(tokenizer, t): lp for t, lp in ev.top} for ev in events],
            "text_offset": offsets}


def chat_logprobs(tokenizer, events: list) -> dict[str, Any]:
    """The chat shape ({"content": [...]}) for these tokens (TokenEvents with logprobs)."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": _piece(tokenizer, token), "logprob": logprob,
                "bytes": list(token_bytes(tokenizer, token))}

    return {"content": [{**entry(ev.token, ev.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in ev.top]} for ev in events]}


def prompt_completion_logprobs(tokenizer, prompt_ids: list[int], entries: tuple) -> dict:
    """The legacy completions shape for an echoed prompt: its tokens from offset 0, each
    with (logprob, top) from `entries` (one per prompt token after the first, which has
    none: null, as OpenAI gives it)."""
    tokens = [_piece(tokenizer, t) for t in prompt_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens,
            "token_logprobs": [None] + [lp for lp, _ in entries],
            "top_logprobs": [None] + [{_piece(tokenizer, t): v for t, v in top}
                                      for _, top in entries],
            "text_offset": offsets}


def joined(first: dict | None, second: dict) -> dict:
    """Two legacy-shape logprobs one after the other (the prompt's, then the answer's)."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}
