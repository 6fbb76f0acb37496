"""`llada` command line: parsing and printing only; every command calls into the library. The top layer:
nothing in the project imports it (tests/test_layers.py)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version

from jax.errors import JaxRuntimeError

from llada_jax.cli.bench import add_bench
from llada_jax.cli.compile import add_compile
from llada_jax.cli.convert import add_convert
from llada_jax.cli.evaluate import add_eval
from llada_jax.cli.generate import add_generate, add_trace
from llada_jax.cli.quantize import add_quantize
from llada_jax.cli.serve import add_serve
from llada_jax.cli.train import add_train
from llada_jax.system.errors import LladaError
from llada_jax.system.interrupts import run_interruptible


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, unless it is unset or the help already names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llada", description="Diffusion LLM (LLaDA) inference in JAX")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('llada-jax')}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (add_generate, add_serve, add_compile, add_quantize, add_convert, add_eval, add_bench, add_trace,
                add_train):
        add(commands)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every command's and subcommand's help shows its defaults (an option without help text too)."""
    for action in parser._actions:
        if action.help is None and action.option_strings and action.default not in (None, False):
            action.help = "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.formatter_class = DefaultsFormatter
                _show_defaults(command)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "prompt_text", None) is not None:
        if args.prompt is not None:
            parser.error("give the prompt either positionally or with --prompt, not both")
        args.prompt = args.prompt_text
    try:
        return run_interruptible("llada", lambda: args.run(args))
    except LladaError as err:
        print(f"llada: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # an unwritable --out, a full disk, ...: the system's one-line reason
        print(f"llada: error: {err.strerror or err}: {err.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except MemoryError as err:  # a host allocation past this machine's memory (numpy names its size)
        print(f"llada: error: out of host memory{f': {err}' if str(err) else ''}", file=sys.stderr)
        return 1
    except JaxRuntimeError as err:  # XLA refused a step, e.g. an allocation past the device's memory
        first = str(err).splitlines()[0]
        hint = ("; a smaller setting fits: --dtype bfloat16, --device-memory-budget BYTES or a quantized checkpoint"
                if "RESOURCE_EXHAUSTED" in first else "")
        print(f"llada: error: {first}{hint}", file=sys.stderr)
        return 1
