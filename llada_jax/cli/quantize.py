"""`llada quantize`: a checkpoint rewritten with int8 or int4 weights (compressed-tensors format)."""

from __future__ import annotations

from llada_jax.cli.flags import model_dir, path_arg
from llada_jax.model.config import read_config
from llada_jax.quant.quantize import BITS, GROUP_SIZES, QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.weights.quant_config import EDGE_SCHEME, default_group_size
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint


def cmd_quantize(args) -> None:
    source = model_dir(args)
    group = args.group_size or default_group_size(read_config(source))  # for 4-bit matrices
    if group is None and 4 in (args.bits, args.head_bits):
        raise LladaError(f"no 4-bit group size ({', '.join(map(str, GROUP_SIZES))}) divides every input width of "
                         "this model's matrices; quantize it with --bits 8 (and --head-bits 8)")
    scheme = QuantScheme(args.bits, group if args.bits == 4 else args.group_size)
    head = QuantScheme(4, group) if args.head_bits == 4 else EDGE_SCHEME
    out = quantize_checkpoint(source, args.out, scheme, head=head, progress=True, force=args.force)
    print(f"{scheme.bits}-bit checkpoint written to {out}")


def add_quantize(commands) -> None:
    quant = commands.add_parser("quantize", help="write an int8 / int4 copy of a checkpoint (compressed-tensors)")
    quant.add_argument("--model", type=path_arg, help="HF LLaDA directory (default: the embedded tiny model)")
    quant.add_argument("--out", required=True, type=path_arg,
                       help="new directory to write (atomically); never the model's own or one holding it")
    quant.add_argument("--force", action="store_true", help="replace an earlier `llada quantize` output in --out")
    quant.add_argument("--bits", type=int, choices=BITS, required=True,
                       help="8: one scale per output channel; 4: group-wise scales")
    quant.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                       help="input columns per scale (default for 4 bits: the largest that divides the model's widths, "
                            "128 for LLaDA-8B; default for 8 bits: one scale per output channel)")
    quant.add_argument("--head-bits", type=int, choices=BITS, default=8,
                       help="the LM head: 8 (default, one scale per vocabulary row) or 4 (group-wise like the layers; "
                            "0.25 GB less for LLaDA-8B); the embedding stays 8-bit")
    quant.set_defaults(run=cmd_quantize, check_weights=False)
