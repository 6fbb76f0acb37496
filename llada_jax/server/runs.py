"""A request's generations seen from the event loop: each runs as a row of the engine, and after every step
its newly settled text comes back as an `Update` through an asyncio queue. An answer that has settled
(EOS, or a stop sequence, in its committed prefix) stops its generation at once: without revision the
committed prefix is final, so the steps left could not change it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import AsyncIterator, Callable

from llada_jax.server.engine import Engine
from llada_jax.server.requests import Job
from llada_jax.system.errors import LladaError
from policies.step_batcher import Cancelled

log = logging.getLogger("llada.serve")
POLL_S = 0.5  # how often a run asks whether its client is still there


@dataclasses.dataclass(frozen=True)
class Update:
    """One choice's progress: text settled since its last update (and, when asked, the canvas)."""

    index: int
    delta: str = ""
    canvas: str | None = None
    finish_reason: str | None = None  # set on the choice's last update
    tokens: int = 0                   # answer tokens settled
    nfe: int = 0                      # forward passes run
    error: str | None = None          # the generation failed (its last update)

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class AnswerSettled(Exception):
    """Raised from a generation's step callback once its answer is final: the generation ends there."""


class Run:
    """The generations of one request, submitted to the engine; iterate `updates()` for their progress."""

    def __init__(self, engine: Engine, jobs: list[Job], tokenizer, canvas: bool):
        """Submits every job (raises `Busy`, with none left running, when the engine is full)."""
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self.jobs, self.tickets = jobs, []
        try:
            for job in jobs:
                ticket = engine.submit(job.prepared, _on_step(job, self._put, tokenizer if canvas else None))
                ticket.future.add_done_callback(functools.partial(_finished, job, self._put))
                self.tickets.append(ticket)
        except BaseException:
            self.cancel()
            raise

    def _put(self, update: Update) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, update)

    async def updates(self, poll: Callable | None = None) -> AsyncIterator[Update]:
        """Every update until each job's last; `poll()` (async, every `POLL_S` however many updates come)
        returning True cancels the run (a client that went away). Leaving early cancels what still runs."""
        remaining, polled = len(self.jobs), self._loop.time()
        try:
            while remaining:
                if poll is not None and self._loop.time() - polled >= POLL_S:
                    if await poll():
                        return
                    polled = self._loop.time()
                try:
                    update = await asyncio.wait_for(self._queue.get(), POLL_S)
                except asyncio.TimeoutError:
                    continue
                remaining -= update.last
                yield update
        finally:
            self.cancel()

    def cancel(self) -> None:
        for ticket in self.tickets:
            if not ticket.future.done():
                ticket.cancel()


def _on_step(job: Job, put: Callable, tokenizer) -> Callable:
    """The step callback of `job`'s generation (on the engine thread): report what settled; stop once final."""
    def on_step(canvas, record) -> None:
        answer_ids = canvas.generated()
        delta, settled = job.answer.update(answer_ids)
        shown = tokenizer.decode(answer_ids, skip_special_tokens=False) if tokenizer is not None else None
        if delta or shown is not None or settled.finish_reason is not None:
            put(Update(job.index, delta, shown, settled.finish_reason, settled.tokens, record.nfe + 1))
        if settled.finish_reason is not None:
            raise AnswerSettled()
    return on_step


def _finished(job: Job, put: Callable, future) -> None:
    """The last update of a generation that ran to its end (or failed); one that settled early has sent it."""
    if future.cancelled():
        put(Update(job.index, error="cancelled"))
        return
    error = future.exception()
    if isinstance(error, AnswerSettled):
        return
    if error is None:
        result = future.result()
        delta, settled = job.answer.update(result.output_ids, final=True)
        put(Update(job.index, delta, None, settled.finish_reason, settled.tokens, result.nfe))
    elif isinstance(error, Cancelled):
        put(Update(job.index, error="cancelled"))
    elif isinstance(error, LladaError):
        put(Update(job.index, error=str(error)))
    else:
        log.error("generation failed", exc_info=error)
        put(Update(job.index, error=f"internal error: {type(error).__name__}: {error}"))
