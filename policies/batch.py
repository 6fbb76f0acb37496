"""Batched generation: every prompt is a row of one `StepBatcher`, decoding with the host loop a prompt alone
runs (`policies.loop.decode_steps`), its canvas left-padded to the batch's longest prompt (LLaDA's reference
alignment: every row's answer, and so every block, sits in the same columns); the batcher runs the rows'
steps as batched backend calls. Rows under the threshold rule or speculation take different numbers of
steps; a row that is ahead runs in the rounds it reaches, beside the others' steps of the same shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from policies.loop import Result, run_rows

RowStep = Callable[[int, object, object], None]  # on_step(row, canvas, record)


def decode_batch(backend, prompts: list[np.ndarray], decode_row: Callable,
                 on_step: RowStep | None = None) -> list[Result]:
    """`decode_row(backend, prompt, offset=..., on_step=...)` (a generator of step calls) for every prompt at
    once; results in prompt order. The first row error is raised once every row has stopped."""
    longest = max(len(prompt) for prompt in prompts)
    rows = [decode_row(backend, prompt, offset=longest - len(prompt),
                       on_step=None if on_step is None else functools.partial(on_step, index))
            for index, prompt in enumerate(prompts)]
    results, batcher = run_rows(backend, rows)
    stats = {"batch_rows": len(prompts), "batched_calls": batcher.calls, "row_steps": batcher.steps}
    return [dataclasses.replace(result, stats={**result.stats, **stats}) for result in results]
