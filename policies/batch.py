"""Batched generation: every prompt is a row of one `StepBatcher`, decoding with the host loop a prompt alone
runs (`policies.loop.decode_steps`), its canvas left-padded to the batch's longest prompt (LLaDA's reference
alignment: every row's answer, and so every block, sits in the same columns); the batcher runs the rows'
steps as batched backend calls. Rows under the threshold rule or speculation take different numbers of
steps; a row that is ahead runs in the rounds it reaches, beside the others' steps of the same shape.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from llada_jax.step_batcher import StepBatcher
from policies.loop import Result

RowStep = Callable[[int, object, object], None]  # on_step(row, canvas, record)


def decode_batch(backend, prompts: list[np.ndarray], decode_row: Callable,
                 on_step: RowStep | None = None) -> list[Result]:
    """`decode_row(backend, prompt, offset=..., on_step=...)` (a generator of step calls) for every prompt at
    once; results in prompt order. The first row error is raised once every row has stopped (the others run to
    the end)."""
    batcher = StepBatcher(backend)
    longest = max(len(prompt) for prompt in prompts)
    ends: list[tuple | None] = [None] * len(prompts)

    def ended(index: int, result, error, seconds: float) -> None:
        ends[index] = (result, error, seconds)

    for index, prompt in enumerate(prompts):
        step = None if on_step is None else (lambda canvas, record, index=index: on_step(index, canvas, record))
        steps = decode_row(backend, prompt, offset=longest - len(prompt), on_step=step)
        batcher.add(steps, lambda result, error, seconds, index=index: ended(index, result, error, seconds))
    try:
        batcher.run()
    except BaseException:  # Ctrl-C: close every row (its side path too), then let it through
        batcher.cancel()
        raise
    failed = next((error for _, error, _ in ends if error is not None), None)
    if failed is not None:
        raise failed
    stats = {"batch_rows": len(prompts), "batched_calls": batcher.calls, "row_steps": batcher.steps}
    return [dataclasses.replace(result, stats={**result.stats, "step_call_seconds": seconds, **stats})
            for result, _, seconds in ends]
