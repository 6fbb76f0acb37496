"""`llada generate` (text, with a live canvas on a terminal) and `llada trace` (a picture of one generation)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import numpy as np

from eval.trace_plot import plot_trace
from llada_jax.cli.flags import (
    add_decoding_flags,
    add_model_flags,
    decoding_kwargs,
    loop_settings,
    policy_arg,
)
from llada_jax.cli.runner import add_runner_flags, generation_runner
from llada_jax.compilation import compile_clock
from llada_jax.display import LiveCanvas
from llada_jax.errors import LladaError


def add_prompt_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT")
    parser.add_argument("--prompt", default=None, help="prompt text")
    parser.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def prompt_ids(args, tokenizer) -> np.ndarray:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise LladaError("give exactly one of a prompt text (positional or --prompt) and --prompt-ids")
    if args.prompt_ids is not None:
        try:
            return np.array([int(part) for part in args.prompt_ids.split(",") if part.strip()], np.int64)
        except ValueError:
            raise LladaError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if tokenizer is None:
        raise LladaError("this model has no tokenizer.json; pass --prompt-ids instead of text")
    text = tokenizer.chat_prompt(args.prompt) if args.chat else args.prompt
    return np.array(tokenizer.encode(text), np.int64)


def compile_timing(args):
    """A clock of JAX compile time for generations JAX runs; nothing to time for a bundle (compiled ahead)."""
    if args.bundle is not None or args.backend != "jax":
        return contextlib.nullcontext()
    return compile_clock()


def cmd_generate(args) -> None:
    config, tokenizer, run = generation_runner(args, loop_settings(args))
    ids = prompt_ids(args, tokenizer)
    live = sys.stderr.isatty() and not args.json and not args.no_visual and args.loop != "compiled"
    canvas = LiveCanvas(tokenizer, config.special_ids_in_vocab(config.eos_token_id, config.eot_token_id))
    with compile_timing(args) as clock:
        result = run(ids, **decoding_kwargs(args), on_step=canvas if live else None)
    compile_s = clock.seconds if clock is not None else 0.0
    speed = len(result.output_ids) / max(result.wall_s - compile_s, 1e-9)
    text = tokenizer.decode(result.output_ids) if tokenizer is not None else None
    if args.json:
        row = {"output_ids": result.output_ids.tolist(), "nfe": result.nfe, "wall_s": result.wall_s,
               "tokens_per_s": speed, **({"compile": clock.as_dict()} if clock is not None else {}),
               **({"stats": result.stats} if result.stats else {})}
        if text is not None:
            row["text"] = text
        print(json.dumps(row))
        return
    print(text if text is not None else " ".join(str(t) for t in result.output_ids))
    compiled = f" ({compile_s:.2f} s of it compiling steps)" if compile_s >= 0.005 else ""
    print(f"[{result.nfe} forward passes, {result.wall_s:.2f} s{compiled}, {speed:.1f} tokens/s generating]",
          file=sys.stderr)


def cmd_trace(args) -> None:
    _, tokenizer, run = generation_runner(args)
    ids = prompt_ids(args, tokenizer)
    result = run(ids, **decoding_kwargs(args))
    pieces = [(tokenizer.decode([int(t)]) or "\u00b7") if tokenizer else str(int(t)) for t in result.output_ids]
    plot_trace(result, pieces, args.out, title=f"{policy_arg(args)}: {result.nfe} steps, {result.revisions} revisions")
    print(f"trace of {result.nfe} steps written to {args.out}")


def add_generate(commands) -> None:
    """`llada generate`."""
    gen = commands.add_parser("generate", help="generate text with a decoder policy")
    add_prompt_flags(gen)
    add_model_flags(gen)
    add_runner_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--no-visual", action="store_true", help="no live canvas even on a terminal")
    add_decoding_flags(gen)
    gen.set_defaults(run=cmd_generate)


def add_trace(commands) -> None:
    """`llada trace`."""
    trace = commands.add_parser("trace", help="PNG of one generation's trajectory (commits, drafts, revisions)")
    add_prompt_flags(trace)
    add_model_flags(trace)
    add_runner_flags(trace)
    trace.add_argument("--out", required=True, help="PNG file")
    add_decoding_flags(trace)
    trace.set_defaults(run=cmd_trace)
