"""Many generations' steps as few backend calls: each generation (a *row*) runs its own decode loop on
its own thread against a `RowBackend`, and the `StepBatcher` runs the rows' step calls together.

Rounds: once every live row has a call waiting, the round runs. Calls of the same kind and shape (full
steps of one canvas shape, window steps of one window shape) run as one backend call over the rows
stacked, cut into the batch sizes the backend offers, reading out every column any of them reads; K/V
commits run one by one. A row's
calls get back exactly what a backend call of that row alone returns, so a row decodes as it would
alone: the same plans, commits and forward passes (only float rounding may differ with the batch).

Rows join and leave at any time (a server's requests join between steps). Every backend step call runs
on the batcher's own dispatcher thread, one at a time.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from llada_jax import kv_state
from llada_jax.errors import LladaError
from llada_jax.readout import Readout, Reads, StepOutput, read_columns


class Cancelled(LladaError):
    """The row was cancelled (its client went away, or the batch was interrupted)."""


@dataclasses.dataclass(eq=False)
class _Call:
    method: str           # "full", "window" or "commit"
    args: tuple
    done: bool = False
    result: object = None
    error: BaseException | None = None

    @property
    def rows(self) -> int:
        """Canvas rows of this call (2 under CFG): of the tokens (full), window ids (window), write mask (commit)."""
        return np.shape(self.args[0 if self.method == "full" else 2])[0]

    def key(self, row: int) -> tuple:
        """Calls with equal keys run as one backend call (a commit never shares one)."""
        if self.method == "full":
            return ("full", self.args[0].shape)
        if self.method == "window":
            state, _, window_ids = self.args[:3]
            return ("window", state.slots, window_ids.shape)
        return ("commit", row)

    @property
    def reads(self) -> Reads | None:
        return self.args[-1]


class StepBatcher:
    """Runs the step calls of the rows that joined it, a round at a time (see the module docstring)."""

    def __init__(self, backend):
        self.backend = backend
        self._sizes = backend.batch_sizes()
        self.calls = 0    # backend step calls made (full and window; commits not counted)
        self.steps = 0    # row steps they computed
        self._cond = threading.Condition()
        self._live: set[int] = set()
        self._pending: dict[int, _Call] = {}
        self._cancelled: set[int] = set()
        self._next_row = 0
        self._closed = False
        self._dispatcher: threading.Thread | None = None

    def join(self) -> "RowBackend":
        with self._cond:
            if self._closed:
                raise LladaError("the step batcher is closed")
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(target=self._dispatch, name="llada-step-batcher", daemon=True)
                self._dispatcher.start()
            row, self._next_row = self._next_row, self._next_row + 1
            self._live.add(row)
            return RowBackend(self, row)

    def leave(self, row: int) -> None:
        with self._cond:
            self._live.discard(row)
            self._pending.pop(row, None)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the dispatcher once no call waits (rows still live get `Cancelled`)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._dispatcher is not None:
            self._dispatcher.join()

    def cancel(self, row: int | None = None) -> None:
        """Make `row`'s (None: every row's) next or waiting call raise `Cancelled`."""
        with self._cond:
            self._cancelled.update(self._live if row is None else {row})
            for waiting in list(self._pending):
                if waiting in self._cancelled:
                    call = self._pending.pop(waiting)
                    call.error, call.done = Cancelled("generation cancelled"), True
            self._cond.notify_all()

    def call(self, row: int, method: str, args: tuple):
        """Wait for the round holding this call; its result (or its error, raised here)."""
        call = _Call(method, args)
        with self._cond:
            if row in self._cancelled or self._closed:
                raise Cancelled("generation cancelled")
            self._pending[row] = call
            self._cond.notify_all()
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _dispatch(self) -> None:
        """The dispatcher thread: the only one that calls the backend (IREE's runtime crashes when several
        threads drive one device; JAX would serialise them anyway). A round runs once every live row has a
        call waiting."""
        with self._cond:
            while True:
                while not self._closed and not (self._pending and len(self._pending) >= len(self._live)):
                    self._cond.wait()
                if self._closed:
                    for call in self._pending.values():
                        call.error, call.done = Cancelled("generation cancelled"), True
                    self._cond.notify_all()
                    return
                pending, self._pending = self._pending, {}
                self._cond.release()  # joins, leaves and cancels need not wait for the device
                try:
                    self._run_round(pending)
                finally:
                    self._cond.acquire()
                self._cond.notify_all()

    def _run_round(self, pending: dict[int, _Call]) -> None:
        groups: dict[tuple, list[_Call]] = {}
        for row in sorted(pending):
            groups.setdefault(pending[row].key(row), []).append(pending[row])
        for calls in groups.values():
            for chunk in _chunks(calls, self._sizes):
                self._run(chunk)

    def _run(self, chunk: list[_Call]) -> None:
        """One backend call for the chunk's calls; each gets its rows of the result (or the error)."""
        try:
            if len(chunk) == 1:
                results = [getattr(self.backend, chunk[0].method)(*chunk[0].args)]
            else:
                joined = _joined_reads([call.reads for call in chunk])
                stacked = _stacked_call(self.backend, chunk, joined)
                results = [_own_columns(out, joined, call.reads)
                           for out, call in zip(_split(self.backend, stacked, len(chunk)), chunk)]
            for call, result in zip(chunk, results):
                call.result = result
        except Exception as error:  # every row of the call sees it
            for call in chunk:
                call.error = error
        finally:
            if chunk[0].method != "commit":
                self.calls, self.steps = self.calls + 1, self.steps + len(chunk)
            for call in chunk:
                call.done = True


def _chunks(calls: list[_Call], sizes: tuple[int, ...] | None) -> list[list[_Call]]:
    """The calls cut into runs whose stacked rows are a batch size the backend has (any: one run). A
    commit's group holds only that commit (see `_Call.key`)."""
    if sizes is None:
        return [calls]
    rows, chunks, at = calls[0].rows, [], 0
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
    if own == joined:
        return out
    at = own if joined is None else tuple(int(i) for i in np.searchsorted(joined, own))
    return dataclasses.replace(out, readout=read_columns(out.readout, at))


def _stacked_call(backend, chunk: list[_Call], reads: Reads | None) -> StepOutput:
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
    return backend.window(state, *(np.concatenate([np.asarray(a) for a in arrays])
                                   for arrays in (visible, window_ids, window_pos, window_valid)), reads)


def _split(backend, out: StepOutput, parts: int) -> list[StepOutput]:
    """Each call's share of a stacked step (calls of equal row counts): its readout row(s) and K/V rows."""
    readouts = [Readout(*parts_of) for parts_of in zip(*(
        [None] * parts if value is None else np.split(np.asarray(value), parts) for value in out.readout))]
    return [StepOutput(readout, keys, values) for readout, keys, values in
            zip(readouts, backend.split_rows(out.keys, parts, axis=1), backend.split_rows(out.values, parts, axis=1))]


class RowBackend:
    """One row's view of the shared backend (`llada_jax.backend.Backend`): its step calls go through
    the batcher; everything else is the shared backend's."""

    def __init__(self, batcher: StepBatcher, row: int):
        self.batcher, self.row = batcher, row

    def __getattr__(self, name):
        return getattr(self.batcher.backend, name)

    def full(self, tokens, valid, reads=None) -> StepOutput:
        return self.batcher.call(self.row, "full", (tokens, valid, reads))

    def window(self, state, visible, window_ids, window_pos, window_valid, reads=None) -> StepOutput:
        return self.batcher.call(self.row, "window", (state, visible, window_ids, window_pos, window_valid, reads))

    def commit(self, state, positions, write, out, tokens, nfe: int):
        return self.batcher.call(self.row, "commit", (state, positions, write, out, tokens, nfe))

    def leave(self) -> None:
        self.batcher.leave(self.row)
