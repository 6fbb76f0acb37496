"""The serving engine: every request's generation is a row of a long-lived `StepBatcher`, so requests that
arrive while others run join them at their next step (step-level continuous batching), and each row still
decodes exactly as its prompt alone.

Admission is bounded: at most `max_batch` generations run at once (one thread each, the host loop a
prompt alone runs) and at most `max_queue` more wait for a free row; beyond that `submit` raises `Busy`.
Generations that need different read-outs (temperature 0 or sampling, CFG, EOS biases) run on backends of
their own, one batcher each; a lock makes their device calls take turns (IREE's runtime crashes when
several threads drive one device).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable

from llada_jax.errors import LladaError
from llada_jax.step_batcher import RowBackend, StepBatcher
from policies.generation import Prepared


class Busy(LladaError):
    """Every row runs and the queue is full: the client should retry later."""


class Ticket:
    """One submitted generation: its future (a `policies.loop.Result`) and its cancellation."""

    def __init__(self, on_cancel: Callable[[], None]):
        self.future: concurrent.futures.Future | None = None
        self._on_cancel = on_cancel
        self._lock = threading.Lock()
        self._row: RowBackend | None = None
        self.cancelled = False

    def attach(self, row: RowBackend) -> None:
        """The row the generation runs as (cancelled at once when the ticket already is)."""
        with self._lock:
            self._row = row
            if self.cancelled:
                row.batcher.cancel(row.row)

    def cancel(self) -> None:
        """Stop the generation at its next step (or before it starts): its future raises `Cancelled` (or is
        cancelled). Nothing happens to a generation that has finished."""
        with self._lock:
            if self.cancelled or self.future.done():
                return
            self.cancelled = True
            if self._row is not None:
                self._row.batcher.cancel(self._row.row)
        self.future.cancel()
        self._on_cancel()


class Engine:
    """Runs `Prepared` single-prompt generations as rows of shared batchers (see the module docstring).
    `make_backend(request)` (a `llada_jax.backend.BackendRequest`) builds a backend; each is sized for `max_batch`
    generations of `max_slots` canvas positions, the most it will run."""

    def __init__(self, make_backend: Callable, max_slots: int, max_batch: int = 8, max_queue: int = 32):
        if max_batch < 1 or max_queue < 0:
            raise LladaError(f"need max_batch >= 1 and max_queue >= 0, got {max_batch} and {max_queue}")
        self.make_backend, self.max_slots = make_backend, max_slots
        self.max_batch, self.max_queue = max_batch, max_queue
        self._threads = concurrent.futures.ThreadPoolExecutor(max_batch, thread_name_prefix="llada-request")
        self._lock = threading.Lock()
        self._device = threading.Lock()
        self._making = threading.Lock()
        self._admitted = 0
        self._running = 0
        self._batchers: dict[tuple, StepBatcher] = {}
        self.cancelled = 0  # generations cancelled before they finished (`Ticket.cancel`: a client went away)

    @property
    def load(self) -> dict:
        """Generations running and waiting now."""
        with self._lock:
            return {"running": self._running, "waiting": self._admitted - self._running}

    def submit(self, prepared: Prepared, on_step: Callable | None = None) -> Ticket:
        """Start (or queue) the generation of `prepared`'s one prompt; `on_step(canvas, record)` runs on its
        thread after every step. Raises `Busy` when the queue is full."""
        if len(prepared.prompts) != 1:
            raise LladaError("the engine runs one prompt per submission")
        with self._lock:
            if self._admitted >= self.max_batch + self.max_queue:
                raise Busy(f"the server is at capacity ({self.max_batch} generations running, {self.max_queue} "
                           "waiting); retry later")
            self._admitted += 1
        ticket = Ticket(self._count_cancel)
        ticket.future = self._threads.submit(self._run, ticket, prepared, on_step)
        ticket.future.add_done_callback(self._released)
        return ticket

    def _released(self, _future: concurrent.futures.Future) -> None:
        with self._lock:
            self._admitted -= 1

    def _count_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def _run(self, ticket: Ticket, prepared: Prepared, on_step: Callable | None):
        with self._lock:
            self._running += 1
        try:
            row = self._batcher(prepared).join()
            try:
                ticket.attach(row)
                return prepared.decode_row(row, prepared.prompts[0], on_step=on_step)
            finally:
                row.leave()
        finally:
            with self._lock:
                self._running -= 1

    def _batcher(self, prepared: Prepared) -> StepBatcher:
        """The batcher of the backend that reads out what `prepared` needs (made on first use, under a lock of
        its own: admission and `load`, which the server's event loop calls, never wait for a backend)."""
        key = (prepared.readout_spec, prepared.biases.logit_bias.tobytes(), prepared.biases.confidence_bias.tobytes(),
               prepared.cfg_scale)
        with self._making:
            if key not in self._batchers:
                backend = self.make_backend(prepared.backend_request(self.max_batch, self.max_slots))
                with self._lock:
                    self._batchers[key] = StepBatcher(DeviceTurns(backend, self._device))
            return self._batchers[key]

    def close(self) -> None:
        """Cancel what runs and waits, then stop every batcher."""
        with self._lock:
            batchers = list(self._batchers.values())
        for batcher in batchers:
            batcher.cancel()
        self._threads.shutdown(wait=True, cancel_futures=True)
        for batcher in batchers:
            batcher.close()


class DeviceTurns:
    """A backend whose calls hold `lock`: the batchers of several backends take turns on the device."""

    def __init__(self, backend, lock: threading.Lock):
        self.backend, self.lock = backend, lock

    def __getattr__(self, name):
        value = getattr(self.backend, name)
        if not callable(value):
            return value

        def in_turn(*args, **kwargs):
            with self.lock:
                return value(*args, **kwargs)
        return in_turn

