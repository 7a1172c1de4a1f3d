"""`--reasoning-parser qwen3`: a chat answer's `<think>...</think>` part as `reasoning_content`.

Rule (SGLang's `qwen3` for models that open the block themselves): an answer whose text,
after leading whitespace, starts with `<think>` is reasoning up to `</think>`, and content
after it (leading whitespace dropped); an answer cut before `</think>` is all reasoning. An
answer that does not start with `<think>` is all content (a prompt that closed the block,
as Qwen3's template does with enable_thinking=False, gives such answers).

`Qwen3Reasoning.feed` takes the text as it streams and returns ("reasoning" | "content",
text) pieces; the pieces of a whole answer fed at once and fed piece by piece are the same
text. Text that could still be the start of a tag is held back until it cannot.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may
    still become the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Qwen3Reasoning:
    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> reasoning -> content, or start -> content
        self._lead = True  # nothing emitted in the current part yet: leading blanks go

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_START):
                self._buf, self._state = head[len(THINK_START):], "reasoning"
            elif final or not THINK_START.startswith(head):
                self._state = "content"
            else:
                return out  # blanks or a part of "<think>" so far
        if self._state == "reasoning":
            end = self._buf.find(THINK_END)
            if end < 0:
                # hold a possible start of </think>, and blanks that may precede it
                keep = 0
                if not final:
                    tag = held_back(self._buf, THINK_END)
                    rest = self._buf[:len(self._buf) - tag]
                    keep = tag + len(rest) - len(rest.rstrip())
                self._emit(out, "reasoning", self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            self._emit(out, "reasoning", self._buf[:end].rstrip())
            self._buf, self._state, self._lead = self._buf[end + len(THINK_END):], "content", True
        self._emit(out, "content", self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if self._lead:
            text = text.lstrip()
        if text:
            out.append((kind, text))
            self._lead = False
