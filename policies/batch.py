"""Batched generation: every prompt decodes on its own thread with the host loop a prompt alone runs, its
canvas left-padded to the batch's longest prompt (LLaDA's reference alignment: every row's answer, and so
every block, sits in the same columns), and a `StepBatcher` runs the rows' steps as batched backend calls.
Rows under the threshold rule or speculation take different numbers of steps; a row that is ahead runs
in the rounds it reaches, beside the others' steps of the same shape.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import numpy as np

from llada_jax.step_batcher import StepBatcher
from policies.loop import Result

RowStep = Callable[[int, object, object], None]  # on_step(row, canvas, record)


def decode_batch(backend, prompts: list[np.ndarray], decode_row: Callable,
                 on_step: RowStep | None = None) -> list[Result]:
    """`decode_row(row_backend, prompt, offset=..., on_step=...)` for every prompt at once; results in prompt
    order. The first row error is raised once every row has stopped (the others run to the end)."""
    batcher = StepBatcher(backend)
    longest = max(len(prompt) for prompt in prompts)
    rows = [batcher.join() for _ in prompts]  # all joined before any starts: the first round waits for all
    results: list[Result | None] = [None] * len(prompts)
    errors: list[BaseException | None] = [None] * len(prompts)

    def run(index: int) -> None:
        step = None if on_step is None else (lambda canvas, record: on_step(index, canvas, record))
        try:
            results[index] = decode_row(rows[index], prompts[index], offset=longest - len(prompts[index]),
                                        on_step=step)
        except BaseException as error:  # reported by the caller's thread
            errors[index] = error
        finally:
            rows[index].leave()

    threads = [threading.Thread(target=run, args=(index,), name=f"llada-row-{index}", daemon=True)
               for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl-C: stop every row at its next step, then let them unwind
        batcher.cancel()
        for thread in threads:
            thread.join()
        raise
    finally:
        batcher.close()
    failed = next((error for error in errors if error is not None), None)
    if failed is not None:
        raise failed
    stats = {"batch_rows": len(prompts), "batched_calls": batcher.calls, "row_steps": batcher.steps}
    return [dataclasses.replace(result, stats={**result.stats, **stats}) for result in results]
