"""`llada convert`: a checkpoint re-laid so that a CPU device uses its weights in place."""

from __future__ import annotations

from llada_jax.cli.flags import model_dir, path_arg
from llada_jax.weights.realign_checkpoint import realign_checkpoint


def cmd_convert(args) -> None:
    out = realign_checkpoint(model_dir(args), args.out, force=args.force, progress=True)
    print(f"checkpoint written to {out}: its weights load in place")


def add_convert(commands) -> None:
    convert = commands.add_parser("convert", help="rewrite a checkpoint's weight files so that they load in place "
                                                  "(the HF writer's are copied at every load)")
    convert.add_argument("--model", type=path_arg, help="HF LLaDA directory (default: the embedded tiny model)")
    convert.add_argument("--out", required=True, type=path_arg,
                         help="new directory to write (atomically); never the model's own or one holding it")
    convert.add_argument("--force", action="store_true", help="replace an earlier `llada convert` output in --out")
    convert.set_defaults(run=cmd_convert, check_weights=False)
