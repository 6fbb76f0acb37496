"""`llada` command line: parsing and printing only; every command calls into the library."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from llada_jax.errors import LladaError


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """Decoder flags shared by generate, eval and bench."""
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="total denoising steps (default: gen-length)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--cfg-scale", type=float, default=0.0)
    parser.add_argument("--remasking", default="low_confidence", help="low_confidence or random")
    parser.add_argument("--policy", default="vanilla", help="vanilla, prefix-cache or dual-cache")
    parser.add_argument("--threshold", type=float, default=None, help="commit all tokens with confidence >= this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forbid-eos", action="store_true", help="never predict EOS (logits set to -inf)")
    parser.add_argument("--no-eos-confidence", action="store_true", help="EOS/EoT predictions get confidence 0")


def decoding_kwargs(args) -> dict:
    return dict(gen_length=args.gen_length, block_length=args.block_length,
                steps=args.steps if args.steps is not None else args.gen_length,
                temperature=args.temperature, cfg_scale=args.cfg_scale, remasking=args.remasking,
                policy=args.policy, threshold=args.threshold, seed=args.seed,
                logits_eos_inf=args.forbid_eos, confidence_eos_eot_inf=args.no_eos_confidence)


def load_model(args):
    from llada_jax.api import load
    from llada_jax.embedded import default_model_dir

    return load(args.model or default_model_dir(), dtype=args.dtype)


def prompt_ids(args, model) -> np.ndarray:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise LladaError("give exactly one of a prompt text (positional or --prompt) and --prompt-ids")
    if args.prompt_ids is not None:
        try:
            return np.array([int(part) for part in args.prompt_ids.split(",") if part.strip()], np.int64)
        except ValueError:
            raise LladaError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if model.tokenizer is None:
        raise LladaError("this model has no tokenizer.json; pass --prompt-ids instead of text")
    text = model.tokenizer.chat_prompt(args.prompt) if args.chat else args.prompt
    return np.array(model.tokenizer.encode(text), np.int64)


def cmd_generate(args) -> None:
    from llada_jax.api import generate
    from llada_jax.display import LiveCanvas

    model = load_model(args)
    ids = prompt_ids(args, model)
    live = sys.stderr.isatty() and not args.json and not args.no_visual
    result = generate(model, ids, **decoding_kwargs(args), on_step=LiveCanvas(model.tokenizer) if live else None)
    text = model.tokenizer.decode(result.output_ids) if model.tokenizer is not None else None
    if args.json:
        row = {"output_ids": result.output_ids.tolist(), "nfe": result.nfe, "wall_s": result.wall_s,
               "tokens_per_s": result.tokens_per_s}
        if text is not None:
            row["text"] = text
        print(json.dumps(row))
        return
    print(text if text is not None else " ".join(str(t) for t in result.output_ids))
    print(f"[{result.nfe} forward passes, {result.wall_s:.2f} s, {result.tokens_per_s:.1f} tokens/s]", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llada", description="Diffusion LLM (LLaDA) inference in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text with a decoder policy")
    gen.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT")
    gen.add_argument("--prompt", default=None, help="prompt text")
    gen.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
    gen.add_argument("--model", default=None, help="HF LLaDA directory (default: the embedded tiny model)")
    gen.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--no-visual", action="store_true", help="no live canvas even on a terminal")
    add_decoding_flags(gen)
    gen.set_defaults(run=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "prompt_text", None) is not None:
        if args.prompt is not None:
            parser.error("give the prompt either positionally or with --prompt, not both")
        args.prompt = args.prompt_text
    try:
        args.run(args)
    except LladaError as err:
        print(f"llada: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llada: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
