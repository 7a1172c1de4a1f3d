"""Structured output: a request's grammar (JSON schema, regex, EBNF, structural tag) compiled
with xgrammar for the model's tokenizer, and its token bitmask applied to the logits on the
device.

Where each part runs:
- the HTTP process checks a grammar (`check_grammar`: parsed without a tokenizer), so a bad
  schema, regex or EBNF is a 400 before anything reaches the engine;
- rank 0 compiles it for the tokenizer (`GrammarBackend`, in a thread of its own: the
  compile overlaps the request's prefill) and keeps one matcher per request (`RowGrammar`);
- each step, the allowed tokens of every row with a grammar are filled into a bitmask on the
  host while the device runs the forward, copied over, and applied to the step's logits
  (`apply_token_bitmask`: disallowed ids -> -inf). Decode CUDA graphs end at the logits, so
  they are untouched; rows without a grammar get all bits set and share the step.

Invariants:
- a matcher has accepted exactly its request's output tokens so far, in order (advanced once
  per token, when the token reaches the host: `engine.Driver`);
- the grammar's stop tokens are the model's EOS ids: once the grammar is complete it allows
  only those, and the request ends on them (even with ignore_eos);
- JSON (schemas, json_object, tool arguments) is generated without optional whitespace
  (separators ", " and ": "): a model, or random weights, cannot spend its tokens on blanks.

xgrammar (`pip install 'cpmoe[structured]'`) is imported only when the first grammar arrives
(its import costs ~2 s); without it a grammar is refused with a GrammarError saying so.
"""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
BITS = 32  # tokens per bitmask word (xgrammar's int32 layout: bit j of word w is 32 w + j)
COMPILED_KEPT = 256  # distinct compiled grammars rank 0 keeps


class GrammarError(ValueError):
    """A grammar that does not parse or compile; the message names what is wrong."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; `text` is the schema (JSON text), regex, EBNF
    or structural tag (JSON text) as the client gave it (json_object: unused)."""

    kind: str
    text: str = ""


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured output needs xgrammar (pip install "
                           "'cpmoe[structured]')") from None
    return xgrammar


def json_schema_ebnf(schema: dict | str) -> str:
    """The EBNF of a JSON schema (strict, no optional whitespace); raises GrammarError."""
    xgr = _xgr()
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return str(xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True))
    except RuntimeError as e:
        raise GrammarError(_message(e)) from None


def check_grammar(spec: GrammarSpec) -> None:
    """Parse the grammar without a tokenizer -> GrammarError naming the problem."""
    if spec.kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")
    _grammar(spec)


def _grammar(spec: GrammarSpec):
    xgr = _xgr()
    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False,
                                                strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        return xgr.Grammar.from_structural_tag(spec.text)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
        raise GrammarError(_message(e)) from None


def _message(e: Exception) -> str:
    """xgrammar's error without its C++ source location ("[time] file.cc:N: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class RowGrammar:
    """One request's matcher: created once its grammar is compiled (a future)."""

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher = None

    def ready(self) -> None:
        """Wait for the compile; raises its error."""
        self._compiled.result()

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advance by the chosen token (it was allowed by this matcher's last bitmask)."""
        if not self.terminated and not self.matcher.accept_token(token):
            raise GrammarError(f"token {token} was chosen but the grammar does not allow it")


class GrammarBackend:
    """Rank 0: the model's tokenizer as xgrammar sees it, a compiler with its cache, and a
    thread that compiles new requests' grammars while the engine steps."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_ids: tuple[int, ...],
                 pin_memory: bool = False) -> None:
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, eos_ids
        self.words = (vocab_size + BITS - 1) // BITS
        self.pin_memory = pin_memory  # masks bound for a GPU: copied without a stream sync
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpmoe-grammar")
        self._compiler = None
        self._batch = None
        # one compile per distinct grammar (a burst of requests with one schema compiles it
        # once); the oldest entries go first past COMPILED_KEPT
        self._compiled: dict[GrammarSpec, Future] = {}
        # The tokenizer's xgrammar view (seconds for a 150K vocabulary) is built now, before
        # the engine serves, as SGLang builds its grammar backend at start: not in the first
        # grammar request's TTFT, and not in a thread beside the first steps (a served run on
        # the H200 at ff2c6a2, which built it in the compile thread, had prefill steps of 1.9
        # and 4.1 s while that thread imported xgrammar and read the tokenizer).
        if importlib.util.find_spec("xgrammar") is not None:
            try:
                self._compiler = self._build_compiler()
            except Exception:  # noqa: BLE001 -- no tokenizer files (--skip-tokenizer-init):
                pass  # the first grammar request's compile raises it again, with its message

    def row(self, spec: GrammarSpec) -> RowGrammar:
        """A matcher for a new request; its grammar compiles in the background."""
        future = self._compiled.pop(spec, None) or self._pool.submit(self._compile, spec)
        self._compiled[spec] = future
        while len(self._compiled) > COMPILED_KEPT:
            del self._compiled[next(iter(self._compiled))]
        return RowGrammar(future)

    def _compile(self, spec: GrammarSpec):
        if self._compiler is None:
            self._compiler = self._build_compiler()
        return self._compiler.compile_grammar(_grammar(spec))

    def _build_compiler(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                  stop_token_ids=list(self.eos_ids))
        return xgr.GrammarCompiler(info)

    def fill(self, rows: list[RowGrammar | None]) -> torch.Tensor:
        """Bitmask [len(rows), words] (int32, host) of the tokens each row may take next: a
        row without a grammar, or whose grammar is complete, allows every token."""
        mask = torch.full((len(rows), self.words), -1, dtype=torch.int32,
                          pin_memory=self.pin_memory)
        live = [(i, r) for i, r in enumerate(rows) if r is not None and not r.terminated]
        if live:
            import xgrammar as xgr
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([r.matcher for _, r in live], mask,
                                                      [i for i, _ in live])
        return mask

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_token_bitmask(logits_RV: torch.Tensor, mask_RW: torch.Tensor) -> torch.Tensor:
    """-> logits with every token whose bit is 0 set to -inf (a new tensor, on the logits'
    device; `mask_RW` may be on the host: it is copied without a stream sync)."""
    rows, vocab = logits_RV.shape
    mask = mask_RW.to(logits_RV.device, non_blocking=True)
    shifts = torch.arange(BITS, dtype=torch.int32, device=logits_RV.device)
    allowed = ((mask[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    return logits_RV.masked_fill(~allowed, float("-inf"))
