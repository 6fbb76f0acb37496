"""XLA compilation as a user meets it: a persistent cache, so a new process reuses the steps an earlier
one compiled, and a clock that tells compile time apart from generation time."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path

import jax
import jax.monitoring

# JAX's monitoring events for the work a jitted call does before it first runs: tracing, lowering to
# StableHLO, and compiling it (or reading it back from the persistent cache).
COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                            "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"})


def use_persistent_cache(directory: Path) -> None:
    """Keep every compiled step in `directory` (the tiny model's steps compile in well under JAX's
    default one-second threshold, so there is none)."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


REQUESTED = "/jax/compilation_cache/compile_requests_use_cache"  # a step to compile, cache consulted
CACHE_HIT = "/jax/compilation_cache/cache_hits"                  # ... and found there


@dataclasses.dataclass
class CompileClock:
    seconds: float = 0.0       # tracing, lowering, compiling or reading back from the cache
    requested: int = 0         # steps compiled or read back (with the persistent cache on)
    from_cache: int = 0        # of them, read back from the persistent cache
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def record(self, event: str, duration_secs: float, **_) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                self.seconds += duration_secs

    def count(self, event: str, **_) -> None:
        with self._lock:
            self.requested += event == REQUESTED
            self.from_cache += event == CACHE_HIT

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "steps": self.requested, "from_cache": self.from_cache}


@contextlib.contextmanager
def compile_clock():
    """A `CompileClock` adding up the seconds JAX spends compiling inside the block (any thread)."""
    clock = CompileClock()
    jax.monitoring.register_event_duration_secs_listener(clock.record)
    jax.monitoring.register_event_listener(clock.count)
    try:
        yield clock
    finally:
        jax.monitoring.unregister_event_duration_listener(clock.record)
        jax.monitoring.unregister_event_listener(clock.count)
