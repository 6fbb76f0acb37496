"""`llada` command line: parsing and printing only; every command calls into the library."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from llada_jax.errors import LladaError

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
    parser.add_argument("--remasking", default="low_confidence", help="low_confidence or random")
    parser.add_argument("--policy", default=None,
                        help="BASE[+speculative[:L[:T]]][+revision[:R[:K]]][@THRESHOLD], BASE = vanilla, "
                             f"prefix-cache, dual-cache (default: {DEFAULT_POLICY}, the fastest setting that "
                             "keeps the held-out accuracy; vanilla is LLaDA's reference decoder, token for token)")
    parser.add_argument("--lookahead", type=int, default=None, help="speculation: blocks ahead to draft (adds +speculative)")
    parser.add_argument("--draft-threshold", type=float, default=None, help="speculation: commit a draft at this confidence")
    parser.add_argument("--revise-threshold", type=float, default=None, help="revision: replace at this confidence (adds +revision)")
    parser.add_argument("--confirmations", type=int, default=None, help="revision: agreeing re-scorings to become stable")
    parser.add_argument("--threshold", type=float, default=None, help="commit all tokens with confidence >= this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forbid-eos", action="store_true", help="never predict EOS (logits set to -inf)")
    parser.add_argument("--no-eos-confidence", action="store_true", help="EOS/EoT predictions get confidence 0")


def policy_spec(args) -> str:
    """--policy (without any @THRESHOLD), with the speculation / revision flags folded into its spec;
    a flag's missing partner takes the spec's value, else the policy's own default."""
    from policies.revision import Revision
    from policies.speculative import Speculative

    base, *parts = policy_arg(args).partition("@")[0].split("+")
    modifiers = {part.split(":")[0]: part.split(":")[1:] for part in parts}
    folds = (("speculative", (args.lookahead, args.draft_threshold), (Speculative.lookahead, Speculative.draft_threshold)),
             ("revision", (args.revise_threshold, args.confirmations), (Revision.revise_threshold, Revision.confirmations)))
    for name, flags, defaults in folds:
        if any(flag is not None for flag in flags):
            given = modifiers.get(name, [])
            modifiers[name] = [str(flag if flag is not None else (given[i] if i < len(given) else defaults[i]))
                               for i, flag in enumerate(flags)]
    return "+".join([base] + [":".join([name, *values]) for name, values in modifiers.items()])


def commit_threshold(args) -> float | None:
    """--threshold, or the THRESHOLD of --policy POLICY@THRESHOLD (the form eval and bench take)."""
    policy = policy_arg(args)
    _, at, value = policy.partition("@")
    if not at:
        return args.threshold
    if args.threshold is not None:
        raise LladaError(f"give the commit threshold once: --policy {policy} or --threshold {args.threshold}")
    try:
        return float(value)
    except ValueError:
        raise LladaError(f"bad threshold in --policy {policy!r}; use POLICY@THRESHOLD, "
                         "e.g. dual-cache@0.9") from None


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF LLaDA directory (default: the embedded tiny model)")
    parser.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16")
    parser.add_argument("--check-weights", action="store_true", help="scan every weight for NaN/Inf before use")


def add_prompt_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt_text", nargs="?", default=None, metavar="PROMPT")
    parser.add_argument("--prompt", default=None, help="prompt text")
    parser.add_argument("--prompt-ids", default=None, help="comma-separated prompt token ids")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def add_runner_flags(parser: argparse.ArgumentParser) -> None:
    """What runs the steps: see `generation_runner`."""
    parser.add_argument("--bundle", default=None, help="run a compiled bundle (IREE) instead of a model directory")
    parser.add_argument("--backend", default="jax", choices=["jax", "iree-host", "iree-vulkan"],
                        help="what runs the steps (iree-*: compiled on first use and cached)")
    parser.add_argument("--device-memory-budget", type=int, default=None, metavar="BYTES",
                        help="device memory for weights + KV state; smaller than the weights: stage them per layer")


def decoding_kwargs(args) -> dict:
    return dict(gen_length=args.gen_length, block_length=args.block_length,
                steps=args.steps if args.steps is not None else args.gen_length,
                temperature=args.temperature, cfg_scale=args.cfg_scale, remasking=args.remasking,
                policy=policy_spec(args), threshold=commit_threshold(args), seed=args.seed,
                logits_eos_inf=args.forbid_eos, confidence_eos_eot_inf=args.no_eos_confidence)


def model_dir(args) -> Path:
    """--model, else the embedded model; with --check-weights its weights are scanned for NaN/Inf first."""
    from llada_jax.config import read_config
    from llada_jax.locations import default_model_dir
    from llada_jax.weights_io import check_finite_weights

    path = Path(args.model) if args.model else default_model_dir()
    if args.check_weights:
        if not path.is_dir():
            raise LladaError(f"model directory {path} does not exist")
        check_finite_weights(path, read_config(path))
    return path


def load_model(args):
    """The model for JAX execution; steps compiled in an earlier process come from XLA's persistent cache."""
    from llada_jax.api import load
    from llada_jax.compilation import use_persistent_cache
    from llada_jax.locations import user_cache_dir

    use_persistent_cache(user_cache_dir("xla"))
    return load(model_dir(args), dtype=args.dtype, device_memory_budget=getattr(args, "device_memory_budget", None))


def cmd_compile(args) -> None:
    from lowering.bundle import compile_bundle

    out = compile_bundle(model_dir(args), args.target, args.out, max_len=args.max_len,
                         window=args.window, dtype=args.dtype, copy_weights=not args.link_weights,
                         device_memory_budget=args.device_memory_budget,
                         progress=lambda message: print(message, file=sys.stderr))
    print(f"bundle written to {out}")


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


def generation_runner(args):
    """(config, tokenizer, generate(ids, **options)) for the chosen model and backend. With a bundle,
    nothing imports JAX: the bundle runtime is numpy + iree.runtime only."""
    budget = getattr(args, "device_memory_budget", None)
    if budget is not None and args.bundle is not None:
        raise LladaError("a bundle's device memory budget is fixed when it is compiled (llada compile "
                         "--device-memory-budget); drop --device-memory-budget")
    if args.bundle is not None:
        if args.model is not None:
            raise LladaError("give either --model or --bundle, not both")
        from llada_jax.bundle_runner import bundle_runner

        return bundle_runner(args.bundle, args.backend)
    if args.backend == "jax":
        model = load_model(args)
        from llada_jax.api import generate

        return model.config, model.tokenizer, lambda ids, **options: generate(model, ids, **options)
    from llada_jax.bundle_runner import bundle_runner
    from lowering.bundle_cache import cached_bundle

    target = {"iree-host": "host", "iree-vulkan": "vulkan"}[args.backend]
    bundle_dir = cached_bundle(model_dir(args), target, dtype=args.dtype,
                               device_memory_budget=budget, progress=lambda m: print(m, file=sys.stderr))
    return bundle_runner(bundle_dir, args.backend)


def cmd_generate(args) -> None:
    from llada_jax.display import LiveCanvas

    config, tokenizer, run = generation_runner(args)
    ids = prompt_ids(args, tokenizer)
    live = sys.stderr.isatty() and not args.json and not args.no_visual
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


def compile_timing(args):
    """A clock of JAX compile time for generations JAX runs; nothing to time for a bundle (compiled ahead)."""
    if args.bundle is not None or args.backend != "jax":
        return contextlib.nullcontext()
    from llada_jax.compilation import compile_clock

    return compile_clock()


def cmd_train(args) -> None:
    from llada_jax.training import TrainSettings, embedded_model_config, export_latest, train

    if args.export_to:
        out_dir, step = export_latest(args.out, args.export_to)
        print(f"checkpoint of step {step} exported to {out_dir}")
        return
    settings = TrainSettings(steps=args.steps, batch=args.batch, learning_rate=args.lr, seed=args.seed,
                             block_aware=args.block_aware, checkpoint_every=args.checkpoint_every)
    config = embedded_model_config(d_model=args.d_model, n_layers=args.n_layers)
    model_dir = train(args.out, settings, config, progress=not args.quiet, stop_at=args.stop_at)
    print(f"trained model written to {model_dir}")


def cmd_eval_tasks(args) -> None:
    from eval.task_eval import GEN_LENGTH, DecoderSetting, evaluate

    model = load_model(args)
    settings = [DecoderSetting.parse(spec) for spec in (args.policy or [DEFAULT_POLICY])]
    if args.block_length < 1 or GEN_LENGTH % args.block_length:
        raise LladaError(f"--block-length must divide the answer length {GEN_LENGTH}, got {args.block_length}")
    rows = [evaluate(model, setting, args.limit, progress=True, block_length=args.block_length)
            for setting in settings]
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"overall": rows[0]["overall"], "runs": rows}))
        return
    for row in rows:
        families = "  ".join(f"{name} {value:.3f}" for name, value in row["families"].items())
        print(f"{row['setting']:<22} overall {row['overall']:.3f}  {families}  NFE {row['mean_nfe']:.2f}  "
              f"rev/answer {row['revisions_per_answer']:.2f}  {row['tokens_per_s']:.0f} tok/s")


DEFAULT_BENCH = ["vanilla", "prefix-cache", "dual-cache", "dual-cache@0.9", "dual-cache+speculative@0.9",
                 "dual-cache+speculative+revision@0.7"]


def bench_prompts(args, tokenizer, config):
    """The held-out tasks, GSM8K problems (--data), or random ids (a model without tokenizer)."""
    from eval.bench import Prompt
    from eval.tasks import exact_match, held_out

    if args.limit is not None and args.limit <= 0:
        raise LladaError(f"--limit must be positive, got {args.limit}")
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [Prompt(rng.integers(0, config.mask_token_id, 32)) for _ in range(args.limit or 4)]
    if args.data is not None:
        from eval.gsm8k import extract_answer, load_problems, prompt_text, same_number

        return [Prompt(np.array(tokenizer.encode(prompt_text(p["question"], [], tokenizer))), p["gold"],
                       lambda text, gold: same_number(extract_answer(text), gold))
                for p in load_problems(args.data, args.limit)]
    return [Prompt(np.array(tokenizer.encode(tokenizer.chat_prompt(e.prompt))), e.answer, exact_match)
            for e in held_out(args.limit or 25)]


def cmd_bench(args) -> None:
    from eval.bench import bench, format_table, plot
    from eval.task_eval import DecoderSetting

    if args.bench_size:
        import tempfile
        from pathlib import Path

        from eval.bench_lowering import bench_model_dir

        args.model = str(bench_model_dir(Path(tempfile.gettempdir()) / "llada-bench"))
    config, tokenizer, run = generation_runner(args)
    settings = [DecoderSetting.parse(spec) for spec in (args.policy or DEFAULT_BENCH)]
    report = bench(run, config, tokenizer, settings, bench_prompts(args, tokenizer, config), args.steps,
                   progress=lambda m: print(m, file=sys.stderr),
                   block_length=args.block_length)
    if args.plot:
        plot(report, args.plot)
    print(json.dumps(report["rows"]) if args.json else format_table(report))


def cmd_trace(args) -> None:
    from eval.trace_plot import plot_trace

    config, tokenizer, run = generation_runner(args)
    ids = prompt_ids(args, tokenizer)
    result = run(ids, **decoding_kwargs(args))
    pieces = [(tokenizer.decode([int(t)]) or "\u00b7") if tokenizer else str(int(t)) for t in result.output_ids]
    plot_trace(result, pieces, args.out, title=f"{policy_arg(args)}: {result.nfe} steps, {result.revisions} revisions")
    print(f"trace of {result.nfe} steps written to {args.out}")


def _add_generate(commands) -> None:
    """`llada generate`."""
    gen = commands.add_parser("generate", help="generate text with a decoder policy")
    add_prompt_flags(gen)
    add_model_flags(gen)
    add_runner_flags(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--no-visual", action="store_true", help="no live canvas even on a terminal")
    add_decoding_flags(gen)
    gen.set_defaults(run=cmd_generate)


def _add_compile(commands) -> None:
    """`llada compile`."""
    comp = commands.add_parser("compile", help="compile a model's steps into an IREE bundle for a target")
    add_model_flags(comp)
    comp.add_argument("--target", required=True, help="host, vulkan, android-arm64, android-adreno, android-mali")
    comp.add_argument("--out", required=True, help="bundle directory to write (atomically)")
    comp.add_argument("--max-len", type=int, default=128, help="longest canvas (prompt + gen-length)")
    comp.add_argument("--window", type=int, default=128, help="widest window step")
    comp.add_argument("--link-weights", action="store_true", help="point at the model's weights instead of copying")
    comp.add_argument("--device-memory-budget", type=int, default=None, metavar="BYTES",
                      help="add per-layer pieces and stream weights through this much device memory")
    comp.set_defaults(run=cmd_compile)


def _add_eval(commands) -> None:
    """`llada eval tasks|gsm8k|humaneval`."""
    ev = commands.add_parser("eval", help="evaluate a model")
    suites = ev.add_subparsers(dest="suite", required=True)
    tasks = suites.add_parser("tasks", help="exact match on the embedded task suite's held-out split")
    add_model_flags(tasks)
    tasks.add_argument("--policy", action="append",
                       help=f"POLICY or POLICY@THRESHOLD; repeat for several (default: {DEFAULT_POLICY})")
    tasks.add_argument("--limit", type=int, default=None, help="examples per family")
    tasks.add_argument("--block-length", type=int, default=8, help="block length of the 32-token answers")
    tasks.add_argument("--json", action="store_true")
    tasks.set_defaults(run=cmd_eval_tasks)
    from eval import gsm8k, humaneval

    gsm8k.add_cli(suites)
    humaneval.add_cli(suites)


def _add_bench(commands) -> None:
    """`llada bench`."""
    be = commands.add_parser("bench", help="several decoders over the same prompts, in one run")
    add_model_flags(be)
    add_runner_flags(be)
    be.add_argument("--bench-size", action="store_true", help="random weights, d_model 1024, 126464 vocab")
    be.add_argument("--policy", action="append", help="POLICY or POLICY@THRESHOLD; repeat (default: a standard set)")
    be.add_argument("--data", default=None, help="GSM8K JSONL instead of the held-out tasks")
    be.add_argument("--limit", type=int, default=None, help="prompts (per family for the tasks)")
    be.add_argument("--steps", type=int, default=32)
    be.add_argument("--block-length", type=int, default=8, help="block length of the 32-token answers")
    be.add_argument("--plot", default=None, help="PNG: latency vs accuracy")
    be.add_argument("--json", action="store_true")
    be.set_defaults(run=cmd_bench)


def _add_trace(commands) -> None:
    """`llada trace`."""
    trace = commands.add_parser("trace", help="PNG of one generation's trajectory (commits, drafts, revisions)")
    add_prompt_flags(trace)
    add_model_flags(trace)
    add_runner_flags(trace)
    trace.add_argument("--out", required=True, help="PNG file")
    add_decoding_flags(trace)
    trace.set_defaults(run=cmd_trace)


def _add_train(commands) -> None:
    """`llada train`."""
    tr = commands.add_parser("train", help="train the embedded tiny model on the task suite (resumable)")
    tr.add_argument("--out", required=True, help="run directory (checkpoints; the model lands in OUT/model)")
    tr.add_argument("--steps", type=int, default=24_000, help="length of the LR schedule")
    tr.add_argument("--batch", type=int, default=64)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--d-model", type=int, default=128)
    tr.add_argument("--n-layers", type=int, default=4)
    tr.add_argument("--block-aware", type=float, default=0.5, help="fraction of block-aware masked examples")
    tr.add_argument("--checkpoint-every", type=int, default=1000)
    tr.add_argument("--stop-at", type=int, default=None, help="stop (and export) at this step of the schedule")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.add_argument("--export-to", default=None, help="only export the run's newest checkpoint to this HF dir")
    tr.set_defaults(run=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llada", description="Diffusion LLM (LLaDA) inference in JAX")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_compile, _add_eval, _add_bench, _add_trace, _add_train):
        add(commands)
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
    except OSError as err:  # an unwritable --out, a full disk, ...: the system's one-line reason
        print(f"llada: error: {err.strerror or err}: {err.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llada: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
