"""The serving engine: every request's generation is a row of a long-lived `StepBatcher`, so requests that
arrive while others run join them at their next round (step-level continuous batching), and each row still
decodes exactly as its prompt alone.

One engine thread owns the batch: it admits waiting generations, applies cancellations and runs the
batchers' rounds; no thread per request. Admission is bounded: at most `max_batch` generations run at once
and at most `max_queue` more wait for a free row; beyond that `submit` raises `Busy`. Generations that need
different read-outs (temperature 0 or sampling, CFG, EOS biases) run on backends of their own, one batcher
each, their rounds in turn on the engine thread (IREE's runtime crashes when several threads drive one device).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Callable

from llada_jax.system.errors import LladaError
from policies.generation import Prepared
from policies.loop import with_call_seconds
from policies.step_batcher import StepBatcher


class Busy(LladaError):
    """Every row runs and the queue is full: the client should retry later."""


class Ticket:
    """One submitted generation: its future (a `policies.loop.Result`) and its cancellation."""

    def __init__(self, engine: "Engine"):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._engine = engine

    def cancel(self) -> None:
        """Stop the generation at its next round (or before it starts): its future raises `Cancelled` (or is
        cancelled). Nothing happens to a generation that has finished."""
        self._engine.cancel(self)


@dataclasses.dataclass(frozen=True)
class _Waiting:
    ticket: Ticket
    prepared: Prepared
    on_step: Callable | None


class Engine:
    """Runs `Prepared` single-prompt generations as rows of shared batchers (see the module docstring).
    `make_backend(request)` (a `policies.backend.BackendRequest`) builds a backend; each is sized for `max_batch`
    generations of `max_slots` canvas positions, the most it will run."""

    def __init__(self, make_backend: Callable, max_slots: int, max_batch: int = 8, max_queue: int = 32):
        if max_batch < 1 or max_queue < 0:
            raise LladaError(f"need max_batch >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.make_backend, self.max_slots = make_backend, max_slots
        self.max_batch, self.max_queue = max_batch, max_queue
        self._cond = threading.Condition()
        self._waiting: list[_Waiting] = []
        self._running: dict[Ticket, tuple[StepBatcher, int] | None] = {}  # None: starting
        self._cancels: set[Ticket] = set()
        self._batchers: dict[tuple, StepBatcher] = {}  # touched by the engine thread only
        self._closed = False
        self._thread: threading.Thread | None = None
        self.cancelled = 0  # generations cancelled before they finished (`Ticket.cancel`: a client went away)

    @property
    def capacity(self) -> int:
        """The most generations it holds at once, running and waiting."""
        return self.max_batch + self.max_queue

    @property
    def load(self) -> dict:
        """Generations running and waiting now."""
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    def submit(self, prepared: Prepared, on_step: Callable | None = None) -> Ticket:
        """Queue the generation of `prepared`'s one prompt; `on_step(canvas, record)` runs on the engine thread
        after every step. Raises `Busy` when the queue is full."""
        if len(prepared.prompts) != 1:
            raise LladaError("the engine runs one prompt per submission")
        with self._cond:
            if self._closed:
                raise LladaError("the engine is closed")
            if len(self._running) + len(self._waiting) >= self.max_batch + self.max_queue:
                raise Busy(f"the server is at capacity ({self.max_batch} generations running, {self.max_queue} "
                           "waiting); retry later")
            ticket = Ticket(self)
            self._waiting.append(_Waiting(ticket, prepared, on_step))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="llada-engine", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """See `Ticket.cancel`; never waits for a running step."""
        with self._cond:
            if ticket.future.done() or ticket in self._cancels:
                return
            self.cancelled += 1
            waiting = next((entry for entry in self._waiting if entry.ticket is ticket), None)
            if waiting is not None:
                self._waiting.remove(waiting)
            else:
                self._cancels.add(ticket)
                self._cond.notify_all()
        if waiting is not None:
            ticket.future.cancel()

    def close(self) -> None:
        """Cancel what runs and waits, then stop the engine thread."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cond.notify_all()
        for entry in waiting:
            entry.ticket.future.cancel()
        if self._thread is not None:
            self._thread.join()
        for batcher in self._batchers.values():
            batcher.cancel()

    def _serve(self) -> None:
        """The engine thread: admit, cancel, run a round of every batcher with rows; until closed."""
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self._cancels or self._running):
                    self._cond.wait()
                if self._closed:
                    return
                free = self.max_batch - len(self._running)
                admitted, self._waiting = self._waiting[:free], self._waiting[free:]
                for entry in admitted:
                    self._running[entry.ticket] = None
                cancels, self._cancels = self._cancels, set()
            for ticket in cancels:
                placed = self._running.get(ticket)
                if placed is not None:
                    placed[0].cancel(placed[1])
            for entry in admitted:
                self._start(entry)
            for batcher in list(self._batchers.values()):
                if batcher.live:
                    try:
                        batcher.round()
                    except Exception as error:  # e.g. no compiled step for this many rows: those rows fail
                        batcher.cancel(error=error)

    def _start(self, entry: _Waiting) -> None:
        """Add the generation to its backend's batcher (it runs to its first step call there)."""
        ticket, prepared = entry.ticket, entry.prepared
        if not ticket.future.set_running_or_notify_cancel():  # its future was cancelled directly
            with self._cond:
                self._running.pop(ticket, None)
            return
        try:
            batcher = self._batcher(prepared)
            steps = prepared.decode_row(batcher.backend, prepared.prompts[0], on_step=entry.on_step)
        except Exception as error:
            self._finished(ticket, None, error, 0.0)
            return
        row = batcher.add(steps, lambda result, error, seconds: self._finished(ticket, result, error, seconds))
        with self._cond:
            if ticket in self._running:  # not already finished at its first call
                self._running[ticket] = (batcher, row)

    def _finished(self, ticket: Ticket, result, error: BaseException | None, seconds: float) -> None:
        with self._cond:
            self._running.pop(ticket, None)
            self._cancels.discard(ticket)
        if error is not None:
            ticket.future.set_exception(error)
        else:
            ticket.future.set_result(with_call_seconds(result, seconds))

    def _batcher(self, prepared: Prepared) -> StepBatcher:
        """The batcher of the backend that reads out what `prepared` needs (made on first use)."""
        key = (prepared.readout_spec, prepared.biases.logit_bias.tobytes(), prepared.biases.confidence_bias.tobytes(),
               prepared.cfg_scale)
        if key not in self._batchers:
            self._batchers[key] = StepBatcher(self.make_backend(prepared.backend_request(self.max_batch,
                                                                                         self.max_slots)))
        return self._batchers[key]

