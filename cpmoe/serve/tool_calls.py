"""Tool calls in the Qwen family's format (`--tool-call-parser qwen25`, SGLang's name):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `Qwen25ToolCalls` parses an answer's text, as it streams, into content and calls: every
  well-formed block (JSON with a string "name" and an object "arguments", or "parameters")
  is a call; a block that is not, or is cut off, stays content. Blank text next to a call
  is dropped (it separates calls); the content of an answer without calls is its text.
- `call_grammar` is the grammar for tool_choice "required" or a named function: one or more
  blocks of the allowed functions (one only without parallel_tool_calls), each argument
  object valid against its function's `parameters` schema, then EOS. A model, even with
  random weights, then always returns calls that parse into the declared arguments.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from cpmoe.engine.grammar import GrammarError, GrammarSpec, json_schema_ebnf
from cpmoe.serve.reasoning import held_back

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def _begin(name: str) -> str:
    return f'{CALL_START}\n{{"name": {json.dumps(name)}, "arguments": '


def call_grammar(functions: list[dict[str, Any]], parallel: bool) -> GrammarSpec:
    """Grammar of one or more calls (`parallel`) of these functions ({name, parameters});
    raises GrammarError naming the function whose parameters schema is not usable."""
    tags = []
    for f in functions:
        try:
            ebnf = json_schema_ebnf(f.get("parameters") or {"type": "object"})
        except GrammarError as e:
            raise GrammarError(f"function {f['name']!r}: parameters: {e}") from None
        tags.append({"type": "tag", "begin": _begin(f["name"]),
                     "content": {"type": "grammar", "grammar": ebnf},
                     "end": "}\n" + CALL_END})
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
           "at_least_one": True, "stop_after_first": not parallel}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def _parse_call(body: str) -> dict[str, str] | None:
    """{"name", "arguments" (JSON text)} of a block's JSON, or None if it is not a call."""
    try:  # strict=False: raw control characters in strings (xgrammar lets some through)
        obj = json.loads(body, strict=False)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Qwen25ToolCalls:
    """feed(text) / finish() -> ("content", text) and ("call", {name, arguments}) items."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._blank = ""  # blanks after the last content: kept only if content follows
        self._after_call = False  # content since the last call is still empty
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        out = self._drain(final=True)
        if self._blank and not self.calls:
            out.append(("content", self._blank))
        self._blank = ""
        return out

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while True:
            if not self._in_call:
                at = self._buf.find(CALL_START)
                if at < 0:
                    keep = 0 if final else held_back(self._buf, CALL_START)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(out, self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(CALL_START):], True
            end = self._buf.find(CALL_END)
            if end < 0:
                if final:  # cut off inside a block: it stays text
                    self._content(out, CALL_START + self._buf)
                    self._buf = ""
                return out
            body, self._buf = self._buf[:end], self._buf[end + len(CALL_END):]
            self._in_call = False
            call = _parse_call(body)
            if call is None:
                self._content(out, CALL_START + body + CALL_END)
                continue
            out.append(("call", call))
            self.calls += 1
            self._blank, self._after_call = "", True

    def _content(self, out: list[tuple[str, Any]], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        if body:
            out.append(("content", body))
            self._after_call = False
