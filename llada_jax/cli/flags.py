"""Flags shared by several `llada` commands: the decoder (policy spec, commit threshold) and the model."""

from __future__ import annotations

import argparse
import re
import sys
from decimal import Decimal
from pathlib import Path

from llada_jax.api import load
from llada_jax.model.config import checked_model_dir, read_config
from llada_jax.model.mesh import MeshSpec, describe
from llada_jax.quant.choice import ACTIVATIONS, KERNELS
from llada_jax.system.compilation import use_persistent_cache
from llada_jax.system.errors import LladaError
from llada_jax.system.locations import default_model_dir, user_cache_dir
from llada_jax.weights.weights_io import check_finite_weights
from policies.block_diffusion import family_decoder
from policies.block_loop_io import baked_block_loops
from policies.compiled_loop import baked_loops, loop_covers
from policies.generation import LOOPS, block_settings
from policies.options import GenerationOptions
from policies.registry import DecoderSetting, make_policy, with_modifier
from policies.sampling import Sampler

# The default decoder of generate and eval: on the embedded model's held-out tasks it scores as well as
# vanilla or better (94.5% vs 92.75% on 400 tasks) at ~20x its speed (README's speculation table).
DEFAULT_POLICY = "dual-cache+speculative@0.9"


def policy_arg(args) -> str:
    """--policy as given; when absent, the default decoder (its base alone when --threshold is given)."""
    if args.policy is not None:
        return args.policy
    return DEFAULT_POLICY.partition("@")[0] if args.threshold is not None else DEFAULT_POLICY


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """Decoder flags shared by generate, eval and bench."""
    parser.add_argument("--gen-length", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="total denoising steps (default: gen-length)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--cfg-scale", type=float, default=0.0)
    parser.add_argument("--remasking", default="low_confidence",
                        help="low_confidence, random, or Dream's margin (topk_margin) and entropy")
    parser.add_argument("--schedule", default="llada",
                        help="tokens committed per step without a threshold: llada (equal shares) or dream[:EPS] "
                             "(Dream's timesteps from 1 to EPS, default 0.001)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="Dream's confidence filter: softmax over the K highest logits (0: off; default 50 "
                             "under --schedule dream, as Dream's diffusion_generate runs under transformers 4.x)")
    parser.add_argument("--top-p", type=float, default=None, help="Dream's nucleus filter before its confidence")
    parser.add_argument("--policy", default=None,
                        help="BASE[+speculative[:L[:T]]][+revision[:R[:K]]][@THRESHOLD], BASE = vanilla, "
                             f"prefix-cache, dual-cache (default: {DEFAULT_POLICY}, the fastest setting that "
                             "keeps the held-out accuracy; vanilla is LLaDA's reference decoder, token for token)")
    parser.add_argument("--lookahead", type=int, default=None,
                        help="speculation: blocks ahead to draft (adds +speculative)")
    parser.add_argument("--draft-threshold", type=float, default=None,
                        help="speculation: commit a draft at this confidence")
    parser.add_argument("--revise-threshold", type=float, default=None,
                        help="revision: replace at this confidence (adds +revision)")
    parser.add_argument("--confirmations", type=int, default=None,
                        help="revision: agreeing re-scorings to become stable")
    parser.add_argument("--threshold", type=float, default=None, help="commit all tokens with confidence >= this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop", choices=LOOPS, default="auto",
                        help="auto: the compiled decode loop where it covers the setting (temperature 0, no CFG, no "
                             "revision, resident weights), else the host loop")
    parser.add_argument("--forbid-eos", action="store_true", help="never predict EOS (logits set to -inf)")
    parser.add_argument("--no-eos-confidence", action="store_true", help="EOS/EoT predictions get confidence 0")
    add_block_flags(parser)


BLOCK_FLAGS = ("editing_threshold", "max_post_steps", "num_to_transfer", "minimal_topk")  # `add_block_flags`' dests


def add_block_flags(parser: argparse.ArgumentParser) -> None:
    """Block diffusion's flags (LLaDA2 models; docs/families.md maps them onto the reference samplers)."""
    block = parser.add_argument_group("block diffusion (LLaDA2)", "on these models --steps counts per block "
                                      "(default: --block-length), the default --policy is dual-cache (the exact "
                                      "block cache; vanilla: uncached) and the default --threshold 0.95")
    block.add_argument("--editing-threshold", type=float, default=None,
                       help="LLaDA2.1's decoder: replace a committed token whose new prediction is above this")
    block.add_argument("--max-post-steps", type=int, default=None, help="LLaDA2.1: editing passes once a block "
                       "has no mask (default 16)")
    block.add_argument("--num-to-transfer", type=int, default=None,
                       help="LLaDA2.1: masks committed per pass when too few pass --threshold (default 1)")
    block.add_argument("--minimal-topk", type=int, default=None,
                       help="LLaDA2.0: at most gen-length / this steps per block (default 1)")


def add_loop_flags(parser: argparse.ArgumentParser) -> None:
    """The decoding setting `llada compile` bakes into a bundle's compiled decode loop (temperature 0)."""
    parser.add_argument("--gen-length", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=8, help="block diffusion (LLaDA2): the bundle holds "
                        "only the steps of blocks this long")
    parser.add_argument("--steps", type=int, default=None, help="total denoising steps (default: gen-length)")
    parser.add_argument("--policy", default=None,
                        help=f"BASE[+speculative[:L[:T]]][@THRESHOLD] (default: {DEFAULT_POLICY})")
    parser.add_argument("--lookahead", type=int, default=None, help="speculation: blocks ahead to draft")
    parser.add_argument("--draft-threshold", type=float, default=None,
                        help="speculation: commit a draft at this confidence")
    parser.add_argument("--threshold", type=float, default=None, help="commit all tokens with confidence >= this")
    parser.add_argument("--no-loop", action="store_true", help="steps only: no compiled decode loop, no run.sh")
    parser.set_defaults(revise_threshold=None, confirmations=None)
    add_block_flags(parser)


def baked_setting(args, slot_sizes, config):
    """The compiled loops the flags of `add_loop_flags` ask for, for the model of `config` (none with
    --no-loop)."""
    if args.no_loop:
        return ()
    if config.block_causal:
        return (baked_block_loops(block_settings(*block_options(args)), slot_sizes),)
    for flag in BLOCK_FLAGS:
        if getattr(args, flag) is not None:
            raise LladaError(f"--{flag.replace('_', '-')} is LLaDA2's (block diffusion); {config.family} models do "
                             "not take it")
    steps = args.steps if args.steps is not None else args.gen_length
    return (baked_loops(policy_spec(args), commit_threshold(args), args.gen_length, args.block_length, steps,
                        slot_sizes),)


def block_options(args) -> tuple[str, GenerationOptions]:
    """(policy, options) of a block-diffusion model's decoding flags, with the family's defaults."""
    policy, threshold = block_decoder(args)
    blocks = {flag: getattr(args, flag) for flag in BLOCK_FLAGS}
    steps = args.steps if args.steps is not None else args.block_length
    return policy, GenerationOptions.of({"gen_length": args.gen_length, "block_length": args.block_length,
                                         "steps": steps, "policy": policy, "threshold": threshold,
                                         **{name: value for name, value in blocks.items() if value is not None}})


def block_decoder(args) -> tuple[str, float | None]:
    """(policy, threshold) on a block-diffusion model: without --policy, the family's default decoder, the
    speculation flags folded in."""
    if args.policy is not None:
        return policy_spec(args), commit_threshold(args)
    policy, threshold = family_decoder(True, None, args.threshold)
    assert policy is not None, "a block-diffusion model has a default decoder"
    return policy_spec(args, policy), threshold


def policy_spec(args, policy: str | None = None) -> str:
    """--policy (or `policy`; without any @THRESHOLD), with the speculation / revision flags folded into its
    spec; a flag's missing partner takes the spec's value, else the policy's own default."""
    spec = DecoderSetting.parse(policy or policy_arg(args)).policy
    for name, flags in (("speculative", (args.lookahead, args.draft_threshold)),
                        ("revision", (args.revise_threshold, args.confirmations))):
        if any(flag is not None for flag in flags):
            spec = with_modifier(spec, name, flags)
    return spec


def commit_threshold(args) -> float | None:
    """--threshold, or the THRESHOLD of --policy POLICY@THRESHOLD (the form eval and bench take)."""
    setting = DecoderSetting.parse(policy_arg(args))
    if setting.threshold is None:
        return args.threshold
    if args.threshold is not None:
        raise LladaError(f"give the commit threshold once: --policy {setting} or --threshold {args.threshold}")
    return setting.threshold


def decoding_kwargs(args, config=None) -> dict:
    """The keyword arguments of `llada_jax.generate` the decoder flags give (for the model of `config`: a
    block-diffusion model has its own defaults, see `add_block_flags`)."""
    kwargs = {"gen_length": args.gen_length, "block_length": args.block_length,
              "steps": args.steps if args.steps is not None else args.gen_length,
              "temperature": args.temperature, "cfg_scale": args.cfg_scale, "remasking": args.remasking,
              "policy": policy_spec(args), "threshold": commit_threshold(args), "seed": args.seed,
              "logits_eos_inf": args.forbid_eos, "confidence_eos_eot_inf": args.no_eos_confidence, "loop": args.loop,
              "schedule": args.schedule, "top_k": args.top_k, "top_p": args.top_p}
    if config is not None and config.block_causal:
        kwargs.update(steps=args.steps if args.steps is not None else args.block_length)
        kwargs["policy"], kwargs["threshold"] = block_decoder(args)
    blocks = {flag: getattr(args, flag) for flag in BLOCK_FLAGS}
    return {**kwargs, **{name: value for name, value in blocks.items() if value is not None}}


def loop_settings(args) -> list[tuple]:
    """The (policy, threshold, gen_length, block_length, steps) a bundle compiled on the fly should bake a
    decode loop for: the decoding flags' setting, when the compiled loop can run it."""
    kwargs = decoding_kwargs(args)
    sampler = Sampler(kwargs["temperature"], kwargs["remasking"], top_k=kwargs["top_k"], top_p=kwargs["top_p"])
    covered = loop_covers(make_policy(kwargs["policy"]), sampler, kwargs["cfg_scale"] > 0.0)
    if args.loop == "host" or not covered or kwargs["schedule"] != "llada":
        return []
    return [(kwargs["policy"], kwargs["threshold"], kwargs["gen_length"], kwargs["block_length"], kwargs["steps"])]


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
BYTES = re.compile(r"\s*(\d+(?:\.\d*)?(?:e\d{1,2})?)\s*([a-z]*)\s*")


def byte_count(text: str) -> int:
    """An argparse type: a number of bytes, whole or with a unit (`2000000000`, `2e9`, `2GB`, `1.5GiB`)."""
    match = BYTES.fullmatch(text.lower())
    if match is None or match[2] not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a number of bytes (2000000000, 2e9, 2GB or 1.5GiB), got {text!r}")
    value = Decimal(match[1]) * BYTE_UNITS[match[2]]  # exact: 1.1kB is 1100
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r}")
    return int(value)


def batch_sizes_arg(text: str) -> tuple[int, ...]:
    """`--batch-sizes 1,4,16`."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, type=path_arg,
                        help="HF LLaDA directory (default: the embedded tiny model)")
    parser.add_argument("--dtype", default=None, help="compute dtype: float32 or bfloat16 (default: float32)")
    parser.add_argument("--check-weights", action="store_true", help="scan every weight for NaN/Inf before use")
    parser.add_argument("--activations", choices=ACTIVATIONS, default=None,
                        help="int8: quantize activations on the fly per 32 columns for 4-bit and 8-bit checkpoints "
                             "(W4A8 / W8A8 matmuls; 4-bit needs --kernels own); float: W4A16 or weight-only int8 "
                             "(default: float)")
    parser.add_argument("--kernels", choices=KERNELS, default=None,
                        help="quantized matmuls on the CPU: own (default where a C compiler exists: our int4/int8 "
                             "kernels, built once per machine into ~/.cache/llada-jax/kernels) or compiler (XLA's "
                             "code); IREE bundles use IREE's code")
    parser.add_argument("--mesh", default=None, metavar="data=N|all,model=M",
                        help="run on several of this host's devices: a batch's rows split over N (data axis), each "
                             "weight matrix over M (model axis, for weights one device cannot hold); default: one")


def add_data_tiling_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-tiling", action="store_true",
                        help="IREE CPU bundles: re-lay the weights into the tiles IREE's matmul kernels read, steps "
                             "position-major (holds a second, re-laid copy of the weights; not with a device memory "
                             "budget; slower than the default feature-major bundle at the README's bench size)")


def model_choices(args) -> dict:
    """--dtype and --activations as given: unset ones are left to the defaults of `load` and the bundle
    compiler, so that a given bundle, which fixed them when compiled, can tell a request from a default."""
    return {name: value for name in ("dtype", "activations") if (value := getattr(args, name, None)) is not None}


def path_arg(text: str) -> str:
    """A path flag's value: an empty one (an unset shell variable) would name the current directory, or with
    --model fall back to the embedded model, and run on something the user did not mean."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a path, got an empty string")
    return text


def model_dir(args) -> Path:
    """--model, else the embedded model; with --check-weights its weights are scanned for NaN/Inf first."""
    path = Path(args.model) if args.model else default_model_dir()
    if args.check_weights:
        check_finite_weights(checked_model_dir(path), read_config(path))
    return path


def load_model(args):
    """The model for JAX execution; steps compiled in an earlier process come from XLA's persistent cache."""
    use_persistent_cache(user_cache_dir("xla"))
    mesh = MeshSpec.parse(args.mesh).build() if getattr(args, "mesh", None) else None
    if mesh is not None:
        print(f"mesh: {describe(mesh)}", file=sys.stderr)
    return load(model_dir(args), **model_choices(args), mesh=mesh, kernels=args.kernels or "own",
                device_memory_budget=getattr(args, "device_memory_budget", None))
