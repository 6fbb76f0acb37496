"""`llada eval tasks`: exact-match accuracy of a model on the held-out task suite, per decoder setting.

A decoder setting is a policy name with an optional threshold: `dual-cache` or `dual-cache@0.9`.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from tqdm import tqdm

from llada_jax.api import generate
from llada_jax.system.errors import LladaError
from llada_jax.training.tasks import exact_match, held_out
from llada_jax.weights.tokenizer import answer_text
from policies.registry import DecoderSetting

GEN_LENGTH, BLOCK_LENGTH = 32, 8


def generate_batch(model, prompts: list[str], decoding: dict) -> tuple[list, float]:
    """Each prompt's `Result` from one batched `generate`, or the `LladaError` its text raised when encoded
    (a character the vocabulary lacks: the others still run); and the batch's seconds per generated prompt."""
    outcomes, encoded = [], []
    for prompt in prompts:
        try:
            encoded.append(np.array(model.tokenizer.encode(prompt)))
            outcomes.append(None)
        except LladaError as err:
            outcomes.append(err)
    if not encoded:
        return outcomes, 0.0
    started = time.perf_counter()
    batch = generate(model, encoded, **decoding)
    assert isinstance(batch, list), "a batch of prompts gives a list of results"
    results = iter(batch)
    share = (time.perf_counter() - started) / len(encoded)
    return [next(results) if outcome is None else outcome for outcome in outcomes], share


def evaluate(model, setting: DecoderSetting, limit: int | None = None, steps: int = GEN_LENGTH,
             progress: bool = False, block_length: int = BLOCK_LENGTH) -> dict:
    """Accuracy per family and overall, mean NFE, revisions per answer and tokens/s for one decoder
    setting (answers of GEN_LENGTH tokens in blocks of `block_length`)."""
    if model.tokenizer is None:
        raise LladaError("the task suite needs a model with a tokenizer")
    examples = held_out() if limit is None else held_out(limit)
    correct: dict[str, list[bool]] = {}
    nfes, revisions, tokens, seconds = [], [], 0, 0.0
    bar = tqdm(examples, desc=str(setting), unit="task", disable=not progress, file=sys.stderr)
    for example in bar:
        ids = np.array(model.tokenizer.encode(model.tokenizer.chat_prompt(example.prompt)))
        result = generate(model, ids, gen_length=GEN_LENGTH, block_length=block_length, steps=steps,
                          policy=setting.policy, threshold=setting.threshold)
        assert not isinstance(result, list), "one prompt gives one result"
        output = answer_text(model.tokenizer, result.output_ids, model.config)
        correct.setdefault(example.family, []).append(exact_match(output, example.answer))
        nfes.append(result.nfe)
        revisions.append(result.revisions)
        tokens += GEN_LENGTH
        seconds += result.wall_s
        bar.set_postfix(accuracy=f"{np.mean([c for family in correct.values() for c in family]):.3f}")
    every = [c for family in correct.values() for c in family]
    return {"setting": str(setting), "overall": float(np.mean(every)),
            "families": {name: float(np.mean(v)) for name, v in sorted(correct.items())},
            "mean_nfe": float(np.mean(nfes)), "revisions_per_answer": float(np.mean(revisions)),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "examples": len(every), "gen_length": GEN_LENGTH, "block_length": block_length, "steps": steps}
