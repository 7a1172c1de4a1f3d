"""A request's structured output and tool use -> the grammar its output must match, whether
its answer is parsed for tool calls, and the tools its chat template is given.

Grammar sources, at most one per request (OpenAI's and SGLang's fields):
- `response_format` {"type": "json_object"} (any JSON object) or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} (the schema, strictly: no properties beyond
  it; `strict` false is served strictly too);
- `regex` / `ebnf` (SGLang's request fields; EBNF in xgrammar's GBNF dialect, rule `root`);
- tool_choice "required" or {"type": "function", "function": {"name"}}: calls in the tool
  parser's format (tool_calls.call_grammar).

Tools need `--tool-call-parser` unless tool_choice is "none" (then the template is not given
them either). tool_choice defaults to "auto" with tools, "none" without (OpenAI).
Every grammar is parsed here (a bad schema, regex or EBNF is one 400 naming the field);
rank 0 compiles it again for the tokenizer (engine/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cpmoe.engine.grammar import GrammarError, GrammarSpec, check_grammar
from cpmoe.serve.tool_calls import call_grammar


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ResponseFormat(_Strict):
    type: str
    json_schema: dict[str, Any] | None = None


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _Named(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


class RequestError(ValueError):
    """A field's value cannot be served: (message, param) for a 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Structure:
    grammar: GrammarSpec | None = None
    tool_calls: bool = False  # parse the answer for calls
    template_tools: list[dict[str, Any]] | None = None  # for the chat template


def _format_grammar(fmt: ResponseFormat | None) -> GrammarSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    if fmt.type != "json_schema":
        raise RequestError(f"response_format type={fmt.type!r} is not supported (only "
                           f"'text', 'json_object', 'json_schema')", "response_format")
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise RequestError("response_format json_schema: expected {\"name\": ..., \"schema\": "
                           "{a JSON schema object}}", "response_format")
    return GrammarSpec("json_schema", json.dumps(schema))


def _tool_grammar(tools: list[Tool], choice: str | NamedToolChoice, parallel: bool
                  ) -> GrammarSpec | None:
    functions = [t.function.model_dump() for t in tools]
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f["name"] == choice.function.name]
        if not named:
            raise RequestError(f"tool_choice names function {choice.function.name!r}, which "
                               f"is not among tools", "tool_choice")
        functions, parallel = named, False
    elif choice != "required":
        return None
    try:
        return call_grammar(functions, parallel)
    except GrammarError as e:
        raise RequestError(f"tools: {e}", "tools") from None


def structure(fmt: ResponseFormat | None, regex: str | None, ebnf: str | None,
              tools: list[Tool] | None, choice: str | NamedToolChoice | None,
              parallel: bool | None, tool_parser: str | None) -> Structure:
    """Raises RequestError naming the field."""
    sources = [(name, g) for name, g in (
        ("response_format", _format_grammar(fmt)),
        ("regex", None if regex is None else GrammarSpec("regex", regex)),
        ("ebnf", None if ebnf is None else GrammarSpec("ebnf", ebnf))) if g is not None]
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise RequestError(f"tool_choice={choice!r}: expected 'none', 'auto', 'required' or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           "tool_choice")
    uses_tools = choice != "none"
    if uses_tools and not tools:
        raise RequestError(f"tool_choice={_shown(choice)} needs tools", "tool_choice")
    if uses_tools and tool_parser is None:
        raise RequestError("tools need a tool-call parser: start the server with "
                           "--tool-call-parser qwen25", "tools")
    calls = _tool_grammar(tools or [], choice, parallel is not False) if uses_tools else None
    if calls is not None:
        sources.append(("tool_choice", calls))
    if len(sources) > 1:
        raise RequestError(f"{' and '.join(n for n, _ in sources)}: give one of them (one "
                           f"grammar per request)", sources[1][0])
    grammar = sources[0][1] if sources else None
    if grammar is not None and sources[0][0] != "tool_choice":
        try:
            check_grammar(grammar)
        except GrammarError as e:
            raise RequestError(f"{sources[0][0]}: {e}", sources[0][0]) from None
    return Structure(grammar, uses_tools,
                     [t.model_dump(exclude_none=True) for t in tools] if uses_tools else None)


def _shown(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
