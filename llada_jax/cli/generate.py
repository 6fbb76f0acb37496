"""`llada generate` (text, with a live canvas on a terminal) and `llada trace` (a picture of one generation)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import numpy as np

from eval.figure_file import check_png_target
from eval.trace_plot import plot_trace
from llada_jax.cli.display import LiveCanvas
from llada_jax.cli.flags import (
    add_decoding_flags,
    add_model_flags,
    decoding_kwargs,
    loop_settings,
    path_arg,
    policy_arg,
)
from llada_jax.cli.runner import Runner, add_runner_flags, generation_runner
from llada_jax.system.compilation import compile_clock
from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import answer_text
from policies.generation import check_token_ids, prepare_generation
from policies.options import GenerationOptions


def add_prompt_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT")
    parser.add_argument("--prompt", default=None, help="prompt text")
    parser.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def check_prompt_flags(args) -> None:
    """The prompt flags' own errors, before any model loads: one prompt, and no flag that would be ignored."""
    if getattr(args, "prompt_file", None) is not None:
        check_prompt_file_flags(args)
    elif (args.prompt is None) == (args.prompt_ids is None):
        raise LladaError("give exactly one of a prompt text (positional or --prompt) and --prompt-ids")
    if getattr(args, "ids", False) and args.prompt_file is None:
        raise LladaError("--ids reads --prompt-file's lines as token ids: give --prompt-file (or use --prompt-ids)")
    if args.chat and (args.prompt_ids is not None or getattr(args, "ids", False)):
        raise LladaError("--chat wraps prompt text in the chat template; token ids are used as given (drop --chat)")


def prompt_ids(args, tokenizer, limit: int) -> np.ndarray:
    """The prompt's ids (see `check_prompt_flags`); text far too long for a context of `limit` tokens is refused
    before tokenizing."""
    if args.prompt_ids is not None:
        return ids_from_text(args.prompt_ids, "--prompt-ids")
    return encoded(args.prompt, args.chat, tokenizer, limit)


def ids_from_text(text: str, what: str) -> np.ndarray:
    parts = text.split(",")
    try:
        if any(not part.strip() for part in parts) and text.strip():
            raise ValueError("an empty item")
        return np.array([int(part) for part in parts if part.strip()], np.int64)
    except (ValueError, OverflowError):
        raise LladaError(f"{what} must be comma-separated token ids, got {text.strip()!r}") from None


def encoded(text: str, chat: bool, tokenizer, limit: int) -> np.ndarray:
    if tokenizer is None:
        raise LladaError("this model has no tokenizer.json; give token ids instead of text")
    return np.array(tokenizer.encode(tokenizer.chat_prompt(text) if chat else text, limit), np.int64)


def file_lines(path: str) -> list[tuple[str, str]]:
    """(where, text) of each non-empty line of --prompt-file, `where` naming its line in the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [(f"line {number} of {path}", line.rstrip("\n")) for number, line in enumerate(handle, 1)
                     if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise LladaError(f"cannot read --prompt-file {path}: {err}") from None
    if not lines:
        raise LladaError(f"--prompt-file {path} holds no prompt")
    return lines


def file_prompts(args, tokenizer, config, limit: int | None) -> list[np.ndarray]:
    """--prompt-file: one prompt per non-empty line, text (or comma-separated ids with --ids), every one
    checked before any runs (against a bundle's --max-len `limit` too): the decoding options first, then each
    line, named by its line number."""
    lines = file_lines(args.prompt_file)
    context = config.max_sequence_length
    prompts = [check_token_ids(ids_from_text(text, where) if args.ids else line_encoded(where, text, args.chat,
                                                                                         tokenizer, context),
                               config, where, allow_mask=False) for where, text in lines]
    decoding = decoding_kwargs(args, config)
    decoding.pop("loop")  # how to run, not what
    options = GenerationOptions.of({**decoding, "limit": limit})
    prepare_generation(config, min(prompts, key=len), options)
    for (where, _), prompt in zip(lines, prompts):
        try:
            prepare_generation(config, prompt, options)
        except LladaError as err:
            raise LladaError(f"{where}: {err}") from None
    return prompts


def line_encoded(where: str, text: str, chat: bool, tokenizer, limit: int) -> np.ndarray:
    """A --prompt-file line's ids; what the tokenizer refuses is named by its line."""
    try:
        return encoded(text, chat, tokenizer, limit)
    except LladaError as err:
        raise LladaError(f"{where}: {err}") from None


def compile_timing(args):
    """A clock of JAX compile time for generations JAX runs; nothing to time for a bundle (compiled ahead)."""
    if args.bundle is not None or args.backend != "jax":
        return contextlib.nullcontext()
    return compile_clock()


def cmd_generate_file(args, runner: Runner) -> None:
    """Every prompt of --prompt-file, --batch-size at a time: one line (text, or JSON with --json) each."""
    config, tokenizer, run, limit = runner
    prompts = file_prompts(args, tokenizer, config, limit)
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start: start + args.batch_size]
        for result in run(batch, **decoding_kwargs(args, config)):
            text = answer_text(tokenizer, result.output_ids, config) if tokenizer is not None else None
            if args.json:
                print(json.dumps({"output_ids": result.output_ids.tolist(), "nfe": result.nfe, "wall_s": result.wall_s,
                                  **({"text": text} if text is not None else {})}), flush=True)
            else:
                answer = text.replace("\n", " ") if text is not None else " ".join(map(str, result.output_ids))
                print(answer, flush=True)
        print(f"[{min(start + len(batch), len(prompts))}/{len(prompts)} prompts]", file=sys.stderr)


def check_prompt_file_flags(args) -> None:
    """The --prompt-file flags' own errors, before any model loads."""
    if args.prompt is not None or args.prompt_ids is not None:
        raise LladaError("give either --prompt-file or a prompt, not both")
    if args.batch_size <= 0:
        raise LladaError(f"--batch-size must be positive, got {args.batch_size}")


def cmd_generate(args) -> None:
    check_prompt_flags(args)
    batch_sizes = (1, args.batch_size) if args.prompt_file is not None else (1,)  # a bundle's compiled sizes
    runner = generation_runner(args, loop_settings(args), batch_sizes=batch_sizes)
    if args.prompt_file is not None:
        return cmd_generate_file(args, runner)
    config, tokenizer, run, _ = runner
    ids = prompt_ids(args, tokenizer, config.max_sequence_length)
    live = sys.stderr.isatty() and not args.json and not args.no_visual and args.loop != "compiled"
    canvas = LiveCanvas(tokenizer, config.special_ids_in_vocab(config.eos_token_id, config.eot_token_id))
    with compile_timing(args) as clock:
        result = run(ids, **decoding_kwargs(args, config), on_step=canvas if live else None)
    assert not isinstance(result, list), "one prompt gives one result"
    compile_s = clock.seconds if clock is not None else 0.0
    speed = len(result.output_ids) / max(result.wall_s - compile_s, 1e-9)
    text = answer_text(tokenizer, result.output_ids, config) if tokenizer is not None else None
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
    check_png_target(args.out, "llada trace", args.force)  # before the model loads
    check_prompt_flags(args)
    config, tokenizer, run, _ = generation_runner(args)
    ids = prompt_ids(args, tokenizer, config.max_sequence_length)
    result = run(ids, **decoding_kwargs(args, config))
    assert not isinstance(result, list), "one prompt gives one result"
    pieces = [(tokenizer.decode([int(t)]) or "\u00b7") if tokenizer else str(int(t)) for t in result.output_ids]
    plot_trace(result, pieces, args.out, title=f"{policy_arg(args)}: {result.nfe} steps, {result.revisions} revisions",
               force=args.force)
    print(f"trace of {result.nfe} steps written to {args.out}")


def add_generate(commands) -> None:
    """`llada generate`."""
    gen = commands.add_parser("generate", help="generate text with a decoder policy")
    add_prompt_flags(gen)
    add_model_flags(gen)
    add_runner_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--no-visual", action="store_true", help="no live canvas even on a terminal")
    gen.add_argument("--prompt-file", default=None, type=path_arg,
                     help="one prompt per line; an answer per line on stdout")
    gen.add_argument("--ids", action="store_true", help="--prompt-file lines are comma-separated token ids")
    gen.add_argument("--batch-size", type=int, default=8, help="--prompt-file prompts generated together")
    add_decoding_flags(gen)
    gen.set_defaults(run=cmd_generate)


def add_trace(commands) -> None:
    """`llada trace`."""
    trace = commands.add_parser("trace", help="PNG of one generation's trajectory (commits, drafts, revisions)")
    add_prompt_flags(trace)
    add_model_flags(trace)
    add_runner_flags(trace)
    trace.add_argument("--out", required=True, type=path_arg, help="PNG file to write (never over a file of yours)")
    trace.add_argument("--force", action="store_true", help="replace an earlier `llada trace` PNG at --out")
    add_decoding_flags(trace)
    trace.set_defaults(run=cmd_trace)
