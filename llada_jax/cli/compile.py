"""`llada compile`: a model's steps, and the decode loop of one decoding setting, compiled into an IREE
bundle for one target."""

from __future__ import annotations

from llada_jax.cli.flags import (
    add_data_tiling_flag,
    add_loop_flags,
    add_model_flags,
    baked_setting,
    batch_sizes_arg,
    byte_count,
    model_choices,
    model_dir,
    path_arg,
)
from llada_jax.cli.progress import stage_printer
from llada_jax.model.config import read_config
from llada_jax.system.errors import LladaError
from lowering.bundle import compile_bundle
from lowering.export import canvas_sizes
from lowering.run_script import SCRIPT
from lowering.targets import TARGETS


def cmd_compile(args) -> None:
    if args.mesh:
        raise LladaError("--mesh shards a model over JAX devices; a bundle runs on one device (drop --mesh)")
    directory = model_dir(args)
    config = read_config(directory) if directory.is_dir() else None  # else compile_bundle says so
    loops = baked_setting(args, canvas_sizes(args.max_len), config) if args.max_len > 0 and config else ()
    out = compile_bundle(directory, args.target, args.out, max_len=args.max_len,
                         window=args.window, **model_choices(args), copy_weights=not args.link_weights,
                         device_memory_budget=args.device_memory_budget, loops=loops,
                         batch_sizes=args.batch_sizes, data_tiling=args.data_tiling,
                         progress=stage_printer(), force=args.force, kernels=args.kernels or "own",
                         block_length=args.block_length)
    script = f"; run it without Python: {out / SCRIPT} ID,ID,..." if (out / SCRIPT).is_file() else ""
    print(f"bundle written to {out}{script}")


def add_compile(commands) -> None:
    """`llada compile`."""
    comp = commands.add_parser("compile", help="compile a model's steps into an IREE bundle for a target")
    add_model_flags(comp)
    comp.add_argument("--target", required=True, help=", ".join(TARGETS))
    comp.add_argument("--out", required=True, type=path_arg, help="new bundle directory to write (atomically)")
    comp.add_argument("--force", action="store_true", help="replace an earlier bundle in --out")
    comp.add_argument("--max-len", type=int, default=128, help="longest canvas (prompt + gen-length)")
    comp.add_argument("--window", type=int, default=128,
                      help="widest window step (block-diffusion models: the block, see --block-length)")
    comp.add_argument("--link-weights", action="store_true", help="point at the model's weights instead of copying")
    comp.add_argument("--device-memory-budget", type=byte_count, default=None, metavar="BYTES",
                      help="add per-layer pieces and stream weights through this much device memory (2e9, 2GB, 1.5GiB)")
    comp.add_argument("--batch-sizes", type=batch_sizes_arg, default=(1,), metavar="N,N,...",
                      help="rows a step takes: a batch of prompts runs in steps of these sizes (1 always included)")
    add_data_tiling_flag(comp)
    add_loop_flags(comp)
    comp.set_defaults(run=cmd_compile)
