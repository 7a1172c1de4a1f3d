"""`cpmoe serve` flags (kept free of web-framework imports so the CLI parser stays light)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

REASONING_PARSERS = ("qwen3",)  # serve/reasoning.py (SGLang's names)
TOOL_CALL_PARSERS = ("qwen25",)  # serve/tool_calls.py


class BindError(RuntimeError):
    """The server's host/port cannot be bound (a user error: exit 2)."""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` clients name (default: the model folder's name)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests accepted but not yet started; past it new ones get 503")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="chat max_tokens when the request gives none (completions: 16)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer (as SGLang): token-id prompts in, token ids out")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="parse chat answers for tool calls in this model family's format "
                        "and serve tools / tool_choice (qwen25: <tool_call>{json}</tool_call>)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="return a chat answer's <think>...</think> part as reasoning_content")
    p.add_argument("--decode-log-interval", type=int, default=40,
                   help="log a 'Decode batch.' line every N decode steps (0: never); "
                        "every prefilling step logs a 'Prefill batch.' line")


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    served_model_name: str | None
    max_queue: int
    default_max_tokens: int
    skip_tokenizer_init: bool = False
    decode_log_interval: int = 40
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        opts = cls(args.host, args.port, args.served_model_name, args.max_queue,
                   args.default_max_tokens, args.skip_tokenizer_init,
                   args.decode_log_interval, args.tool_call_parser, args.reasoning_parser)
        if not 0 <= opts.port < 65536:
            raise ValueError(f"--port {opts.port}: expected 0..65535")
        if opts.decode_log_interval < 0:
            raise ValueError(f"--decode-log-interval must be >= 0, got "
                             f"{opts.decode_log_interval}")
        for flag in ("max_queue", "default_max_tokens"):
            if getattr(opts, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(opts, flag)}")
        return opts
