"""GSM8K accuracy (`llada eval gsm8k`), answers extracted as the common harnesses do it (`#### N`, else the
last number; `$` and commas dropped; compared as numbers). Each problem's row is appended to `--out` as it
finishes; a rerun with the same file skips the problems already there. Over several hosts, each solves its
share into its own part file (`eval.hosts`)."""

from __future__ import annotations

import re
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eval.context_fit import skipped_reasons
from eval.hosts import HostShare
from eval.jsonl import RowWriter, finished_rows, model_setting, read_jsonl, run_setting
from eval.task_eval import generate_batch
from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import answer_text

# A number as written in GSM8K text: optional sign and dollar, thousands groups, optional decimals.
NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
FINAL = re.compile(rf"\s*({NUMBER.pattern})")
STOP_TEXT = "Question:"  # a few-shot continuation starts the next problem here
# The GSM8K test split (openai/grade-school-math, MIT), shipped with the package: 1,319 problems.
BUNDLED_TEST = Path(__file__).resolve().parent / "data" / "gsm8k_test.jsonl.gz"


def extract_answer(text: str) -> str | None:
    """The number right after the last `####`, else the last number in `text`, without `$` and commas."""
    _, marker, after = text.rpartition("####")
    found = FINAL.match(after) if marker else None
    numbers = [found.group(1)] if found else NUMBER.findall(text)
    return numbers[-1].replace("$", "").replace(",", "") if numbers else None


def same_number(answer: str | None, gold: str | None) -> bool:
    """Numeric equality of two answers: "1,000" == "1000.0"."""
    if answer is None or gold is None:
        return False
    try:
        return Decimal(answer.replace(",", "").replace("$", "")) == Decimal(gold.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return False


def load_problems(path=None, limit: int | None = None) -> list[dict]:
    """GSM8K rows (`question`, `answer` ending in `#### N`), each with its extracted `gold` number; the
    bundled test split unless `path` is given."""
    path = BUNDLED_TEST if path is None else path
    if limit is not None and limit <= 0:
        raise LladaError(f"--limit must be > 0, got {limit}")
    rows = read_jsonl(path, ("question", "answer"))[:limit]
    if not rows:
        raise LladaError(f"{path} holds no problems")
    for number, row in enumerate(rows, start=1):
        if "####" not in row["answer"] or extract_answer(row["answer"]) is None:
            raise LladaError(f"{path}: problem {number} has no final '#### N' answer")
    return [dict(row, gold=extract_answer(row["answer"])) for row in rows]


def load_shots(path, shots: int) -> list[dict]:
    """The first `shots` solved problems of the training file (none when shots == 0)."""
    if shots < 0:
        raise LladaError(f"--shots must be >= 0, got {shots}")
    if shots == 0:
        return []
    if path is None:
        raise LladaError(f"--shots {shots} needs --train-data FILE to take the solved examples from")
    examples = load_problems(path)
    if len(examples) < shots:
        raise LladaError(f"--shots {shots} but {path} holds only {len(examples)} problems")
    return examples[:shots]


def prompt_text(question: str, shots: list[dict], tokenizer=None) -> str:
    """lm-eval's format: solved `Question:/Answer:` pairs, then the open question; in the chat template
    when a tokenizer is given."""
    solved = "".join(f"Question: {shot['question']}\nAnswer: {shot['answer']}\n\n" for shot in shots)
    text = f"{solved}Question: {question}\nAnswer:"
    return tokenizer.chat_prompt(text) if tokenizer is not None else text


def solve(model, batch: list[int], prompts: dict[int, str], golds: dict[int, str], decoding: dict) -> list[dict]:
    """Generate for a batch of problems (one batched `generate`) and score them: their result rows."""
    outcomes, share = generate_batch(model, [prompts[index] for index in batch], decoding)
    rows = []
    for index, outcome in zip(batch, outcomes):
        row = {"index": index, "prompt": prompts[index], "gold": golds[index]}
        if isinstance(outcome, LladaError):  # text the vocabulary lacks: scored wrong, with the reason
            rows.append({**row, "output": "", "extracted": None, "correct": False, "nfe": 0, "latency_s": 0.0,
                         "error": str(outcome)})
            continue
        output = answer_text(model.tokenizer, outcome.output_ids, model.config).split(STOP_TEXT)[0]
        extracted = extract_answer(output)
        rows.append({**row, "output": output, "extracted": extracted, "correct": same_number(extracted, golds[index]),
                     "nfe": outcome.nfe, "latency_s": outcome.wall_s, "share_s": share})
    return rows


def evaluate(model, problems: list[dict], shots: list[dict], decoding: dict, *, chat: bool = False,
             out: Path | None = None, progress: bool = True, batch_size: int = 1,
             share: HostShare = HostShare(), skip_too_long: bool = False) -> dict:
    """Solve every problem of this host's `share` not already in its results file (`share.part(out)`),
    `batch_size` at a time, appending each row; then summarize the share. A prompt too long for the model's
    context refuses the run before its first step, or with `skip_too_long` is recorded as skipped."""
    if model.tokenizer is None:
        raise LladaError("GSM8K needs a model with a tokenizer (tokenizer.json)")
    if batch_size < 1:
        raise LladaError(f"--batch-size must be >= 1, got {batch_size}")
    prompts = {index: prompt_text(p["question"], shots, model.tokenizer if chat else None)
               for index, p in enumerate(problems) if share.owns(index)}
    run = run_setting("gsm8k", decoding, shots=len(shots), chat=chat, **model_setting(model))
    path = share.part(out)
    with RowWriter(path) as writer:
        rows = finished_rows(path, "prompt", prompts, run)
        todo = [index for index in prompts if index not in rows]
        golds = {index: problems[index]["gold"] for index in todo}
        skipped = skipped_reasons(model, {index: prompts[index] for index in todo}, decoding,
                                  skip_too_long, len(prompts))
        with tqdm(total=len(prompts), initial=len(rows), desc="gsm8k", file=sys.stderr, disable=not progress,
                  dynamic_ncols=True) as bar:
            def record(row: dict) -> None:
                rows[row["index"]] = row = {**row, "run": run, "problems": len(problems)}
                writer.write(row)
                bar.update()

            for index, reason in skipped.items():
                record({"index": index, "prompt": prompts[index], "gold": golds[index], "output": "",
                        "extracted": None, "correct": False, "nfe": 0, "latency_s": 0.0, "skipped": reason})
            todo = [index for index in todo if index not in skipped]
            for start in range(0, len(todo), batch_size):
                for row in solve(model, todo[start: start + batch_size], prompts, golds, decoding):
                    record(row)
                scored = [row["correct"] for row in rows.values() if "skipped" not in row]
                bar.set_postfix(accuracy=f"{np.mean(scored):.3f}")
    return summarize([rows[index] for index in sorted(rows)], run)


def summarize(rows: list[dict], run: dict) -> dict:
    """Accuracy over the problems that ran, None if none did (`skipped`: prompts too long for the model's
    context, counted apart); speed over the generated ones (`errors`: prompts the model's vocabulary cannot
    represent, scored wrong); the setting of `run` (see `eval.jsonl.run_setting`)."""
    scored = [row for row in rows if "skipped" not in row]
    generated = [row for row in scored if "error" not in row]
    correct = sum(row["correct"] for row in scored)
    seconds = sum(row.get("share_s", row["latency_s"]) for row in generated)
    return {"accuracy": correct / len(scored) if scored else None, "correct": correct, "problems": len(scored),
            "skipped": len(rows) - len(scored), "errors": len(scored) - len(generated),
            "mean_nfe": float(np.mean([row["nfe"] for row in generated])) if generated else 0.0,
            "tokens_per_s": len(generated) * run["gen_length"] / seconds if seconds else 0.0,
            "shots": run["shots"], "chat": run["chat"], **{key: run[key] for key in
                                             ("gen_length", "block_length", "steps", "policy", "threshold")}}
