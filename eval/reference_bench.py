"""`llada bench --reference DIR`: the public PyTorch reference decoders timed in the same run, on the same
prompts and weights, beside ours: per comparable row, the reference's median seconds per answer (`ref(s)`),
ours against it (`x/ref`, above 1: ours is faster) and the fraction of answers whose tokens are identical
(`same`). The reference runs twice, before and after ours, and each answer keeps its faster time: a machine
whose speed drifts during the run cannot flatter ours.

DIR is a checkout of Fast-dLLM (its `llada/generate.py` and `llada/model/`); vanilla, prefix-cache and
dual-cache (with or without @THRESHOLD) have a reference decoder there. The reference runs in a child
process (`eval/reference_child.py`) of `--reference-python`, an interpreter with torch (and the
transformers its model code imports): llada-jax itself needs neither.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from llada_jax.system.errors import LladaError
from llada_jax.system.host_cpu import usable_threads
from policies.registry import DecoderSetting

CHILD = Path(__file__).with_name("reference_child.py")
REFERENCE_POLICIES = ("vanilla", "prefix-cache", "dual-cache")


def has_reference(setting: DecoderSetting) -> bool:
    return setting.policy in REFERENCE_POLICIES


def check_checkout(root: str, python: str) -> None:
    """The checkout and the interpreter, before any model loads."""
    if not (Path(root) / "llada" / "generate.py").is_file():
        raise LladaError(f"--reference {root}: no llada/generate.py there; give a checkout of Fast-dLLM")
    if shutil.which(python) is None:
        raise LladaError(f"--reference-python {python}: not an executable file or a command on PATH")


def check_reference(root: str, python: str, settings: list[DecoderSetting]) -> None:
    """Before any model loads: the checkout, the interpreter and at least one comparable setting."""
    check_checkout(root, python)
    if not any(has_reference(setting) for setting in settings):
        raise LladaError(f"--reference: the reference has only {', '.join(REFERENCE_POLICIES)} (with or without "
                         "@THRESHOLD); none of the --policy settings is one of them")


def run_reference(root: str, python: str, model: Path, config, prompts: list[list[int]],
                  settings: list[DecoderSetting], workload: dict, progress=None,
                  label: str = "") -> dict[DecoderSetting, list[dict]]:
    """Each comparable setting's reference answers, in prompt order: {seconds, nfe, answer}. `label` tags
    the progress lines."""
    decoders = [{"policy": s.policy, "threshold": s.threshold} for s in settings if has_reference(s)]
    job = {"reference": str(Path(root).resolve()), "model": str(Path(model).resolve()), "prompts": prompts,
           "decoders": decoders, "mask_id": config.mask_token_id, "threads": usable_threads(),
           "gen_length": workload["gen_length"], "block_length": workload["block_length"],
           "steps": workload["steps"]}
    answers: dict[DecoderSetting, list[dict]] = {}
    for row in filter(None, map(answer_row, run_child(python, job, "decoders"))):
        setting = DecoderSetting(row["policy"], row["threshold"])
        answers.setdefault(setting, []).append(row)
        if progress:
            progress(f"reference{label} {setting} prompt {row['prompt']}: {row['seconds']:.2f} s")
    return answers


def reference_forward(root: str, python: str, model: Path, dtype: str, vocab: int, widths: list[int],
                      repeats: int) -> dict:
    """The reference model's load time, first forward, median forward per width (logits at every position)
    and peak RSS, on `model`'s weights in `dtype`, with as many threads as this process may use."""
    job = {"kind": "forward", "reference": str(Path(root).resolve()), "model": str(Path(model).resolve()),
           "dtype": dtype, "vocab": vocab, "widths": widths, "repeats": repeats,
           "threads": usable_threads()}
    rows = [row for row in map(json_line, run_child(python, job, "model")) if row and "load_s" in row]
    if not rows:
        raise LladaError("the reference model printed no timings")
    return rows[-1]


def run_child(python: str, job: dict, what: str):
    """The child's stdout lines as it prints them; a failure is one line naming its last error."""
    with tempfile.TemporaryFile("w+") as errors:
        executable = shutil.which(python)
        if executable is None:
            raise LladaError(f"--reference-python {python}: no such program")
        child = subprocess.Popen([executable, str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=errors, text=True)
        assert child.stdin is not None and child.stdout is not None  # both are pipes
        child.stdin.write(json.dumps(job))
        child.stdin.close()
        yield from child.stdout
        if child.wait() != 0:
            errors.seek(0)
            lines = errors.read().strip().splitlines() or ["(nothing on stderr)"]
            raise LladaError(f"the reference {what} failed (exit {child.returncode}): {lines[-1]}")


def json_line(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def answer_row(line: str) -> dict | None:
    """One of the child's answers, or None for anything else on its stdout (the reference's own prints)."""
    row = json_line(line)
    return row if isinstance(row, dict) and {"policy", "threshold", "answer", "seconds"} <= row.keys() else None


def faster_pass(passes: list[dict[DecoderSetting, list[dict]]]) -> dict[DecoderSetting, list[dict]]:
    """Per setting and prompt, the answer of the pass that took the least time."""
    return {setting: [min(answers, key=lambda answer: answer["seconds"])
                      for answers in zip(*(one[setting] for one in passes))] for setting in passes[0]}


def add_reference_columns(rows: list[dict], reference: dict[DecoderSetting, list[dict]]) -> None:
    """ref(s), x/ref and same on every row with a reference decoder (rows carry `setting_key` and their
    `answers`)."""
    for row in rows:
        theirs = reference.get(row["setting_key"])
        if not theirs:
            continue
        row["ref_latency_s"] = statistics.median(answer["seconds"] for answer in theirs)
        row["speedup_vs_reference"] = row["ref_latency_s"] / row["median_latency_s"]
        row["same_tokens"] = statistics.mean(float(list(ours) == answer["answer"])
                                             for ours, answer in zip(row["answers"], theirs))
