"""Incremental detokenization with stop strings.

Invariants:
- The pieces `add` and `finish` return concatenate to the decode of all tokens (special tokens
  skipped), cut before the first occurrence of any stop string.
- A piece never ends inside a multi-byte character: text whose decode ends in U+FFFD (an
  incomplete UTF-8 sequence so far) is held back until a later token completes it, or until
  `finish`, which releases it as it is.
- The last (longest stop - 1) characters are held back while a stop string could still be
  completing across them.
- Stop strings apply once `min_tokens` tokens were taken (vLLM's rule for min_tokens); text
  released before that is never searched again.

Only a window of recent tokens is decoded per step (the two-offset scheme: decode from
`_prefix`, emit what lies beyond the decode up to `_read`), so the cost per token is constant.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.text = ""  # complete text decoded so far (cut at a stop once one is seen)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False  # a stop string was found: later tokens are ignored
        self._prefix = 0  # ids[_prefix:_read] were decoded into text already (context)
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # --skip-tokenizer-init: token ids only, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _step(self, final: bool) -> None:
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, token: int) -> str:
        """Take one generated token; -> the text that can be released now (maybe "")."""
        if self.stopped:
            return ""
        self.ids.append(token)
        self._step(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """-> everything still held back (generation ended)."""
        if self.stopped:
            return ""
        self._step(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        stops = self.stops if len(self.ids) >= self.min_tokens else ()
        hits = [i for i in (self.text.find(s, self.sent) for s in stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[:min(hits)]
            end = len(self.text)
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece
