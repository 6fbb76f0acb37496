"""Many generations' steps as few backend calls. Each generation (a *row*) is a generator of its step calls
(`policies.backend.BackendCall`, as `policies.loop.decode_steps` yields them); the `StepBatcher` owns the
rows and advances them together, on its caller's thread: no thread per row.

Rounds: every live row has one call pending. Calls of the same kind and shape (full steps of one canvas
shape, window steps of one window shape) run as one backend call over the rows stacked, cut into the batch
sizes the backend offers, reading out every column any of them reads; K/V commits run one by one. Each row is
sent exactly what a backend call of that row alone returns and runs on to its next call, so a row decodes as
it would alone: the same plans, commits and forward passes (only float rounding may differ with the batch).

Rows join and leave between rounds (a server's requests join at their first step).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Generator

import numpy as np

from llada_jax.model import kv_state
from llada_jax.model.readout import Readout, Reads, StepOutput, read_columns
from llada_jax.system.errors import LladaError
from policies.backend import BackendCall

# A row's end: done(its generator's return value or None, its error or None, seconds in its step calls).
Done = Callable[[object, BaseException | None, float], None]


class Cancelled(LladaError):
    """The row was cancelled (its client went away, or the batch was interrupted)."""


@dataclasses.dataclass(eq=False)
class _Row:
    steps: Generator[BackendCall, object, object]
    done: Done
    call: BackendCall | None = None
    seconds: float = 0.0


def call_rows(call: BackendCall) -> int:
    """Canvas rows of a call (2 under CFG): of the tokens (full), window ids (window), write mask (commit)."""
    return np.shape(call.args[0 if call.method == "full" else 2])[0]


def call_key(call: BackendCall, row: int) -> tuple:
    """Calls with equal keys run as one backend call (a commit never shares one)."""
    if call.method == "full":
        return ("full", call.args[0].shape)
    if call.method == "window":
        state, _, window_ids = call.args[:3]
        return ("window", state.slots, window_ids.shape)
    return ("commit", row)


class StepBatcher:
    """Advances the rows added to it a round at a time (see the module docstring)."""

    def __init__(self, backend):
        self.backend = backend
        self._sizes = backend.batch_sizes()
        self.calls = 0    # backend step calls made (full and window; commits not counted)
        self.steps = 0    # row steps they computed
        self._rows: dict[int, _Row] = {}
        self._next_row = 0

    @property
    def live(self) -> int:
        return len(self._rows)

    def add(self, steps: Generator[BackendCall, object, object], done: Done) -> int:
        """A new row: its generator runs to its first call (`done` at once if it ends or fails there)."""
        row, self._next_row = self._next_row, self._next_row + 1
        self._rows[row] = _Row(steps, done)
        self._advance(row, next, steps)
        return row

    def cancel(self, row: int | None = None, error: BaseException | None = None) -> None:
        """End `row` (None: every row) now: its generator is closed and its `done` gets `error` (by default
        `Cancelled`)."""
        for one in [row] if row is not None else list(self._rows):
            entry = self._rows.pop(one, None)
            if entry is not None:
                entry.steps.close()
                entry.done(None, error or Cancelled("generation cancelled"), entry.seconds)

    def run(self) -> None:
        """Rounds until no row is left."""
        while self._rows:
            self.round()

    def round(self) -> None:
        """Every live row's pending call, stacked by kind and shape; then each row runs to its next call."""
        pending = {row: entry.call for row, entry in sorted(self._rows.items()) if entry.call is not None}
        groups: dict[tuple, list[int]] = {}
        for row, call in pending.items():
            groups.setdefault(call_key(call, row), []).append(row)
        outcomes: dict[int, tuple] = {}
        for rows in groups.values():
            at = 0
            for chunk in _chunks([pending[row] for row in rows], self._sizes):
                started = time.perf_counter()
                results = self._run(chunk)
                seconds = time.perf_counter() - started
                for row, outcome in zip(rows[at: at + len(chunk)], results):
                    outcomes[row] = outcome
                    self._rows[row].seconds += seconds
                at += len(chunk)
        for row, (result, error) in outcomes.items():
            if error is None:
                self._advance(row, self._rows[row].steps.send, result)
            else:
                self._advance(row, self._rows[row].steps.throw, error)

    def _advance(self, row: int, resume: Callable, value) -> None:
        """Resume the row's generator with `value`; keep its next call, or end the row."""
        entry = self._rows[row]
        try:
            entry.call = resume(value)
        except StopIteration as finished:
            del self._rows[row]
            entry.done(finished.value, None, entry.seconds)
        except Exception as error:  # the row's own failure; the other rows go on
            del self._rows[row]
            entry.done(None, error, entry.seconds)

    def _run(self, chunk: list[BackendCall]) -> list[tuple]:
        """One backend call for the chunk's calls: (result, None) each, or (None, the error) for all."""
        try:
            if len(chunk) == 1:
                results = [chunk[0].run(self.backend)]
            else:
                joined = _joined_reads([_reads(call) for call in chunk])
                stacked = _stacked_call(self.backend, chunk, joined)
                results = [_own_columns(out, joined, _reads(call))
                           for out, call in zip(_split(self.backend, stacked, len(chunk)), chunk)]
            return [(result, None) for result in results]
        except Exception as error:  # every row of the call sees it
            return [(None, error)] * len(chunk)
        finally:
            if chunk[0].method != "commit":
                self.calls, self.steps = self.calls + 1, self.steps + len(chunk)


def _reads(call: BackendCall) -> Reads | None:
    return call.args[-1]


def _chunks(calls: list[BackendCall], sizes: tuple[int, ...] | None) -> list[list[BackendCall]]:
    """The calls cut into runs whose stacked rows are a batch size the backend has (any: one run). A lone call
    runs as it is, as a generation alone does. A commit's group holds only that commit (see `call_key`)."""
    if sizes is None or len(calls) == 1:
        return [calls]
    rows, chunks, at = call_rows(calls[0]), [], 0
    while at < len(calls):
        fits = [size // rows for size in sizes if size % rows == 0 and size // rows <= len(calls) - at]
        if not fits:
            raise LladaError(f"the backend has no step for {rows} rows (its batch sizes: {list(sizes)})")
        chunks.append(calls[at: at + max(fits)])
        at += max(fits)
    return chunks


def _joined_reads(reads: list) -> Reads | None:
    """The columns a stacked call reads out: every column one of its calls reads (None: all)."""
    if any(own is None for own in reads):
        return None
    return tuple(sorted(set().union(*reads)))


def _own_columns(out: StepOutput, joined: Reads | None, own: Reads | None) -> StepOutput:
    """A call's share of a stacked step's readout cut to the columns it asked for."""
    if own == joined or own is None:  # None: every column, and then the stacked call read every column too
        return out
    at = own if joined is None else tuple(int(i) for i in np.searchsorted(joined, own))
    return dataclasses.replace(out, readout=read_columns(out.readout, at))


def _stacked_call(backend, chunk: list[BackendCall], reads: Reads | None) -> StepOutput:
    """The chunk's calls as one backend call over their rows stacked (in chunk order), reading `reads`."""
    columns = list(zip(*(call.args[:-1] for call in chunk)))
    if chunk[0].method == "full":
        tokens, valid = columns
        return backend.full(np.concatenate(tokens), np.concatenate([np.asarray(v) for v in valid]), reads)
    states, visible, window_ids, window_pos, window_valid = columns
    state = kv_state.KVState(backend.join_rows([s.keys for s in states], axis=1),
                             backend.join_rows([s.values for s in states], axis=1),
                             np.concatenate([s.slot_token for s in states]),
                             np.concatenate([s.slot_nfe for s in states]))
    blocks = None
    if any(call.blocks is not None for call in chunk):  # a call without blocks is one block: all zeros
        blocks = np.concatenate([np.zeros(np.shape(call.args[2]), np.int32) if call.blocks is None else call.blocks
                                 for call in chunk])
    return backend.window(state, *(np.concatenate([np.asarray(a) for a in arrays])
                                   for arrays in (visible, window_ids, window_pos, window_valid)), reads,
                          blocks=blocks)


def _split(backend, out: StepOutput, parts: int) -> list[StepOutput]:
    """Each call's share of a stacked step (calls of equal row counts): its readout row(s) and K/V rows."""
    readouts = [Readout(*parts_of) for parts_of in zip(*(
        [None] * parts if value is None else np.split(np.asarray(value), parts) for value in out.readout))]
    return [StepOutput(readout, keys, values) for readout, keys, values in
            zip(readouts, backend.split_rows(out.keys, parts, axis=1), backend.split_rows(out.values, parts, axis=1))]
