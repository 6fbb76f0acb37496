"""What runs the steps of `llada generate`, `trace` and `bench`: JAX on a model directory, or IREE on a
bundle (given, or compiled on first use and cached)."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, NamedTuple, Sequence

from llada_jax.api import generate
from llada_jax.backends.select import OpenBundle, open_bundle
from llada_jax.bundle_runner import generate_with_bundle
from llada_jax.cli.flags import (
    add_data_tiling_flag,
    byte_count,
    load_model,
    model_choices,
    model_dir,
    path_arg,
)
from llada_jax.model.config import LLaDAConfig, read_config
from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import Tokenizer, load_tokenizer
from lowering.bundle_cache import cached_bundle
from lowering.export import canvas_sizes
from policies.compiled_loop import baked_loops


def add_runner_flags(parser: argparse.ArgumentParser) -> None:
    """What runs the steps: see `generation_runner`."""
    parser.add_argument("--bundle", default=None, type=path_arg,
                        help="run a compiled bundle (IREE) instead of a model directory")
    parser.add_argument("--backend", default="jax", choices=["jax", "iree-host", "iree-vulkan"],
                        help="what runs the steps (iree-*: compiled on first use and cached)")
    parser.add_argument("--device-memory-budget", type=byte_count, default=None, metavar="BYTES",
                        help="device memory for weights + KV state (2e9, 2GB, 1.5GiB); smaller than the weights: "
                             "stage them per layer")
    add_data_tiling_flag(parser)


class Runner(NamedTuple):
    """The chosen model's config and tokenizer, generate(ids, **options), and the longest canvas it runs: a
    bundle's compiled --max-len, None for the model's own context."""

    config: LLaDAConfig
    tokenizer: Tokenizer | None
    run: Callable
    limit: int | None


def generation_runner(args, loops: Sequence[tuple] = (), batch_sizes: tuple[int, ...] = (1,)) -> Runner:
    """What generates for the chosen model and backend (see `opened_source`). A bundle runs through the bundle
    runner: IREE steps, no JAX in the generation (the CLI process itself has JAX loaded)."""
    source = opened_source(args, loops, batch_sizes)
    if isinstance(source, OpenBundle):
        run = functools.partial(generate_with_bundle, source)
        return Runner(source.config, load_tokenizer(source.bundle.path), run, source.bundle.manifest["max_len"])
    return Runner(source.config, source.tokenizer, lambda ids, **options: generate(source, ids, **options), None)


def _checked_against(opened: OpenBundle, args) -> OpenBundle:
    """A bundle computes as it was compiled: a model flag asking otherwise is refused, not ignored."""
    manifest = opened.bundle.manifest
    if getattr(args, "check_weights", False):
        raise LladaError("--check-weights scans a model's weights; a bundle's files are checked by their checksums")
    for flag, name, compiled in (("--dtype", "dtype", manifest["compute_dtype"]),
                                 ("--activations", "activations", manifest["activations"])):
        asked = model_choices(args).get(name, compiled)
        if asked != compiled:
            raise LladaError(f"this bundle was compiled with {flag} {compiled}; drop {flag} {asked} (or compile "
                             "another bundle)")
    return opened


def opened_source(args, loops: Sequence[tuple] = (), batch_sizes: tuple[int, ...] = (1,)):
    """What runs the steps: a loaded model (JAX) or an open bundle (IREE: given, or compiled on first use and
    cached, baking a decode loop for each of `loops` (policy, threshold, gen_length, block_length, steps)
    and steps for each of `batch_sizes` rows)."""
    budget = getattr(args, "device_memory_budget", None)
    if budget is not None and args.bundle is not None:
        raise LladaError("a bundle's device memory budget is fixed when it is compiled (llada compile "
                         "--device-memory-budget); drop --device-memory-budget")
    if getattr(args, "mesh", None) and (args.bundle is not None or args.backend != "jax"):
        raise LladaError("--mesh shards a model over JAX devices; an IREE bundle runs on one device (drop --mesh, "
                         "or use --backend jax)")
    if getattr(args, "kernels", None) and args.bundle is not None:
        raise LladaError("a bundle's kernels are fixed when it is compiled (llada compile --kernels); drop --kernels")
    if args.data_tiling and (args.bundle is not None or args.backend == "jax"):
        raise LladaError("--data-tiling is an IREE compile flag: use it with --backend iree-host (or llada compile); "
                         "a given bundle keeps the flags it was compiled with")
    if args.bundle is not None:
        if args.model is not None:
            raise LladaError("give either --model or --bundle, not both")
        return _checked_against(open_bundle(args.bundle, args.backend), args)
    if args.backend == "jax":
        return load_model(args)
    target = {"iree-host": "host", "iree-vulkan": "vulkan"}[args.backend]
    config = read_config(model_dir(args))
    sizes = canvas_sizes(config.max_sequence_length)
    baked = tuple(baked_loops(policy, threshold, gen_length, block_length, steps, sizes)
                  for policy, threshold, gen_length, block_length, steps in (setting[:5] for setting in loops))
    bundle_dir = cached_bundle(model_dir(args), target, **model_choices(args), loops=baked, batch_sizes=batch_sizes,
                               device_memory_budget=budget,
                               kernels=args.kernels or "own", block_length=getattr(args, "block_length", None),
                               data_tiling=args.data_tiling,
                               progress=lambda m: print(m, file=sys.stderr))
    return open_bundle(bundle_dir, args.backend)
