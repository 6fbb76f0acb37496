"""Where the revision policy's side path runs: a second backend on a worker thread (concurrent with the
dense path), or the dense backend itself, inline.

A side job only reads a snapshot (canvas tokens, KV state) taken when it is submitted and returns its
results; the caller merges them at a fixed point of the decode loop. So whether the job ran inline or
on the thread, and however long it took, the merged results and the tokens are the same.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from llada_jax.model import kv_state
from llada_jax.model.readout import StepOutput
from policies.backend import Backend


@dataclasses.dataclass
class SidePath:
    backend: object                                  # runs the side path's window steps
    concurrent: bool
    to_side: Callable[[kv_state.KVState], kv_state.KVState] = lambda kv: kv  # dense-path KV -> side arrays
    to_dense: Callable[[StepOutput], StepOutput] = lambda out: out           # side K/V -> dense-path arrays
    seconds: float = 0.0       # side path compute time
    waited: float = 0.0        # time the dense path spent waiting for side results
    _pool: ThreadPoolExecutor | None = None

    def submit(self, job: Callable, kv: kv_state.KVState, *args) -> Future:
        """Run `job(backend, kv, *args)` on the side path; `kv` is converted (copied) here, on the caller's
        thread, so the job never touches the dense path's buffers."""
        side_kv = self.to_side(kv)
        if not self.concurrent:
            done: Future = Future()
            done.set_result(self._timed(job, side_kv, *args))
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llada-side-path")
        return self._pool.submit(self._timed, job, side_kv, *args)

    def join(self, future: Future):
        started = time.perf_counter()
        result = future.result()
        self.waited += time.perf_counter() - started
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def stats(self) -> dict:
        hidden = 1.0 - self.waited / self.seconds if self.concurrent and self.seconds > 0 else 0.0
        return {"side_seconds": self.seconds, "side_wait_seconds": self.waited,
                "side_hidden_fraction": max(0.0, hidden), "side_concurrent": self.concurrent}

    def _timed(self, job: Callable, kv: kv_state.KVState, *args):
        started = time.perf_counter()
        try:
            return job(self.backend, kv, *args)
        finally:
            self.seconds += time.perf_counter() - started


def side_path_for(backend: Backend) -> SidePath:
    """On the backend's side backend, concurrently, when it offers one (IREE: XLA on the host); else on
    the backend itself, inline."""
    side = backend.side_backend()
    if side is None:
        return SidePath(backend, concurrent=False)
    return SidePath(side.backend, concurrent=True, to_side=side.to_side, to_dense=side.to_dense)
