"""`llada bench`: several decoders over the same prompts, in one run."""

from __future__ import annotations

import argparse
import functools
import json
import sys

import numpy as np

from eval.bench import ENGINE_CONFIG, ENGINE_WORKLOAD, Prompt, bench, format_table, plot
from eval.bench_lowering import bench_model_dir
from eval.figure_file import check_png_target
from eval.gsm8k import extract_answer, load_problems, prompt_text, same_number
from eval.reference_bench import check_reference, run_reference
from eval.task_eval import GEN_LENGTH
from llada_jax.cli.flags import add_model_flags, batch_sizes_arg, model_dir, path_arg
from llada_jax.cli.runner import add_runner_flags, generation_runner
from llada_jax.system.errors import LladaError
from llada_jax.system.locations import user_cache_dir
from llada_jax.training.tasks import exact_match, held_out
from policies.compiled_loop import loop_covers
from policies.registry import DecoderSetting, make_policy

DEFAULT_BENCH = ["vanilla", "prefix-cache", "dual-cache", "dual-cache@0.9", "dual-cache+speculative@0.9",
                 "dual-cache+speculative+revision@0.7"]


def bench_prompts(args, tokenizer, config):
    """The held-out tasks, GSM8K problems (--data), or random ids (a model without tokenizer)."""
    if args.limit is not None and args.limit <= 0:
        raise LladaError(f"--limit must be positive, got {args.limit}")
    if tokenizer is None:
        rng = np.random.default_rng(0)
        count = max(args.limit or 4, max(args.batch_sizes))  # a full batch of the largest size at least
        return [Prompt(rng.integers(0, config.mask_token_id, args.prompt_length)) for _ in range(count)]
    if args.data is not None:
        return [Prompt(np.array(tokenizer.encode(prompt_text(p["question"], [], tokenizer))), p["gold"],
                       lambda text, gold: same_number(extract_answer(text), gold))
                for p in load_problems(args.data, args.limit)]
    return [Prompt(np.array(tokenizer.encode(tokenizer.chat_prompt(e.prompt))), e.answer, exact_match)
            for e in held_out(args.limit or 25)]


def resolve_workload(args) -> None:
    """--bench-size: the engine-size checkpoint and its workload, for every shape flag not given."""
    workload = ENGINE_WORKLOAD if args.bench_size else {"gen_length": GEN_LENGTH, "block_length": 8, "steps": 32,
                                                        "prompt_length": 32}
    for name, value in workload.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        elif getattr(args, name) <= 0:
            raise LladaError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.bench_size:
        args.model = str(bench_model_dir(user_cache_dir("bench-models"), ENGINE_CONFIG))


def check_reference_flags(args, settings: list[DecoderSetting]) -> None:
    """--reference, checked before any model loads."""
    if args.reference is None:
        return
    if args.bundle is not None:
        raise LladaError("--reference runs the reference on a checkpoint: give --model (the one the bundle was "
                         "compiled from), not --bundle")
    check_reference(args.reference, args.reference_python, settings)


def reference_runner(args, config, prompts: list[Prompt], settings: list[DecoderSetting], progress):
    """`run(label)`: the reference decoders' answers on `prompts` (None without --reference)."""
    if args.reference is None:
        return None
    workload = {name: getattr(args, name) for name in ("gen_length", "block_length", "steps")}
    return functools.partial(run_reference, args.reference, args.reference_python, model_dir(args), config,
                             [prompt.ids.tolist() for prompt in prompts], settings, workload, progress)


def cmd_bench(args) -> None:
    settings = [DecoderSetting.parse(spec) for spec in (args.policy or DEFAULT_BENCH)]
    if args.plot:
        check_png_target(args.plot, "llada bench", args.force)  # before minutes of benchmarking
    resolve_workload(args)
    check_reference_flags(args, settings)
    loops = ("host", "compiled") if args.loop == "both" else (args.loop,)
    baked = [(s.policy, s.threshold, args.gen_length, args.block_length, args.steps) for s in settings
             if loops != ("host",) and loop_covers(make_policy(s.policy))]
    config, tokenizer, run, _ = generation_runner(args, baked, args.batch_sizes)
    prompts = bench_prompts(args, tokenizer, config)
    progress = lambda message: print(message, file=sys.stderr)  # noqa: E731
    reference = reference_runner(args, config, prompts, settings, progress)

    def measure(generate, reference=None) -> dict:
        return bench(generate, config, tokenizer, settings, prompts, args.steps, progress=progress,
                     block_length=args.block_length, loops=loops, gen_length=args.gen_length,
                     batch_sizes=args.batch_sizes, reference=reference)

    report = measure(run, reference)
    if args.mesh:  # the same rows on one device, measured in the same run
        alone = generation_runner(argparse.Namespace(**{**vars(args), "mesh": None}), baked, args.batch_sizes)
        report = mesh_report(report, measure(alone.run), args.mesh)
    if args.plot:
        plot(report, args.plot, force=args.force)
    print(json.dumps(report["rows"]) if args.json else format_table(report))


def mesh_report(meshed: dict, alone: dict, mesh: str) -> dict:
    """Each row on one device, then on the mesh with its gain over one device (`x/1dev`)."""
    rows = []
    for one, many in zip(alone["rows"], meshed["rows"]):
        rows.append({**one, "setting": f"{one['setting']} [1 device]"})
        rows.append({**many, "setting": f"{many['setting']} [{mesh}]",
                     "mesh_gain": many["answers_per_s"] / one["answers_per_s"]})
    return {**meshed, "rows": rows}


def add_bench(commands) -> None:
    """`llada bench`."""
    be = commands.add_parser("bench", help="several decoders over the same prompts, in one run")
    add_model_flags(be)
    add_runner_flags(be)
    be.add_argument("--bench-size", action="store_true",
                    help="random weights at a compute-bound size (d_model 1024, 12 layers, vocab 32768), "
                         "64-token prompts, 128-token answers in blocks of 32, 128 steps (the checkpoint is written "
                         "once, into ~/.cache/llada-jax/bench-models)")
    be.add_argument("--policy", action="append", help="POLICY or POLICY@THRESHOLD; repeat (default: a standard set)")
    be.add_argument("--data", default=None, type=path_arg, help="GSM8K JSONL instead of the held-out tasks")
    be.add_argument("--limit", type=int, default=None, help="prompts (per family for the tasks)")
    be.add_argument("--steps", type=int, default=None, help="denoising steps per answer (default 32)")
    be.add_argument("--gen-length", type=int, default=None, help="answer length (default 32)")
    be.add_argument("--block-length", type=int, default=None, help="block length of the answers (default 8)")
    be.add_argument("--prompt-length", type=int, default=None,
                    help="random prompt ids per prompt, for a model without tokenizer (default 32)")
    be.add_argument("--loop", choices=("auto", "host", "compiled", "both"), default="auto",
                    help="decode loop per setting; both: a host-loop and a compiled-loop row for each")
    be.add_argument("--batch-sizes", type=batch_sizes_arg, default=(1,), metavar="N,N,...",
                    help="prompts per generate call; a row per size with answers/s and its gain over 1 (x/b1)")
    be.add_argument("--reference", default=None, type=path_arg, metavar="DIR",
                    help="a checkout of Fast-dLLM: its PyTorch decoders (vanilla, prefix-cache, dual-cache) timed on "
                         "the same prompts and weights in the same run (columns ref(s), x/ref, same)")
    be.add_argument("--reference-python", default=sys.executable, metavar="PYTHON",
                    help="interpreter with torch and transformers for --reference (default: this one)")
    be.add_argument("--plot", default=None, type=path_arg,
                    help="PNG to write: latency vs accuracy (never over a file of yours)")
    be.add_argument("--force", action="store_true", help="replace an earlier `llada bench` PNG at --plot")
    be.add_argument("--json", action="store_true")
    be.set_defaults(run=cmd_bench)
