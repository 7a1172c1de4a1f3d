"""`cpmoe serve`: the OpenAI-compatible server (its web imports load only for this command)."""

from __future__ import annotations

import argparse

from cpmoe.cli.flags import InputError, context_from_args, engine_options, resolve, tokenizer_of
from cpmoe.parallel.launch import launch, torchrun_rank


def cmd_serve(args: argparse.Namespace) -> int:
    from cpmoe.serve.options import BindError, ServeOptions
    layout, model_dir, cfg, device, dtype = resolve(args)
    engine = engine_options(args, cfg)
    context = context_from_args(args, cfg)
    try:
        opts = ServeOptions.from_args(args)
    except ValueError as e:
        raise InputError(str(e)) from None
    tokenizer = None if opts.skip_tokenizer_init else tokenizer_of(model_dir)
    if tokenizer is None and not opts.skip_tokenizer_init:
        raise InputError(f"--model {model_dir}: no tokenizer files; serve needs a tokenizer "
                         f"(or --skip-tokenizer-init: token ids in and out)")
    from cpmoe.serve.server import serve, serve_in_world  # web imports only for this command
    try:
        if torchrun_rank() is not None:  # torchrun: one server over the whole world
            return launch(serve_in_world, layout.world_size, device, opts, engine, layout,
                          model_dir, cfg, context, device, dtype, tokenizer)
        return serve(opts, engine, layout, model_dir, cfg, context, device, dtype, tokenizer)
    except BindError as e:
        raise InputError(str(e)) from None
