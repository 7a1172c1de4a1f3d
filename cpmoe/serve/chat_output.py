"""A chat answer's text -> OpenAI message deltas: reasoning, content and tool calls.

The text goes through the reasoning parser (if the server has one) and the content through
the tool-call parser (if the request may call tools), in that order, as the text streams.
`feed` / `finish` return the deltas of one choice's chunks ({"reasoning_content": ...},
{"content": ...}, {"tool_calls": [one call]}); `message` merges every delta into the
non-streamed message, so both shapes carry the same text and calls.
"""

from __future__ import annotations

from typing import Any

from cpmoe.serve.reasoning import Qwen3Reasoning
from cpmoe.serve.tool_calls import Qwen25ToolCalls, new_call_id


class ChatOutput:
    def __init__(self, reasoning: bool, tools: bool) -> None:
        self.reasoning = Qwen3Reasoning() if reasoning else None
        self.tools = Qwen25ToolCalls() if tools else None
        self.calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._content(text, final=False)
        return self._split(self.reasoning.feed(text), final=False)

    def finish(self) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._content("", final=True)
        return self._split(self.reasoning.finish(), final=True)

    def _split(self, parts: list[tuple[str, str]], final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            else:
                out += self._content(text, final=False)
        if final:
            out += self._content("", final=True)
        return out

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.tools is None:
            return [{"content": text}] if text else []
        items = self.tools.feed(text) if not final else self.tools.feed(text) + \
            self.tools.finish()
        out = []
        for kind, value in items:
            if kind == "content":
                out.append({"content": value})
                continue
            out.append({"tool_calls": [{"index": self.calls, "id": new_call_id(),
                                        "type": "function", "function": value}]})
            self.calls += 1
        return out

    def message(self, deltas: list[dict[str, Any]]) -> dict[str, Any]:
        """The assistant message these deltas make up (content None when there is only a
        tool call, as OpenAI gives it)."""
        content = "".join(d.get("content", "") for d in deltas)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(d.get("reasoning_content", "")
                                               for d in deltas) or None
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        if calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
            msg["content"] = content or None
        return msg
