"""Swap-optimized execution: run a model whose weights exceed the device memory budget.

Weights are packed once, at load time, into one contiguous aligned host buffer per stage (each
decoder layer; the final norm + head), straight from the memory-mapped checkpoint; the embedding
stays on the host (a row gather). A forward pass streams the stages through a ring of N device
slots sized to the budget: while stage i computes in slot i mod N, a background thread copies stage
i + N - 1 ahead into the slot the previous stage released. The KV state stays resident; it must fit
next to at least one slot, or the budget is refused with the minimum it would need.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

import numpy as np

from llada_jax.config import LLaDAConfig
from llada_jax.errors import LladaError
from llada_jax.packing import head_layout, layer_layout


@dataclasses.dataclass(frozen=True)
class StagedWeights:
    embedding: np.ndarray        # [E, D] host (memory-mapped or loaded), gathered on the host
    layers: tuple[np.ndarray, ...]
    head: np.ndarray
    dtype: object

    @property
    def slot_bytes(self) -> int:
        return max(max(p.nbytes for p in self.layers), self.head.nbytes)

    @property
    def stages(self) -> tuple[np.ndarray, ...]:
        return (*self.layers, self.head)


def pack_weights(tensors, config: LLaDAConfig, dtype) -> StagedWeights:
    """Pack every stage from (HF name, host array) pairs read one at a time; a stage is packed as soon
    as its last tensor arrives, so at most a few stages are ever held unpacked."""
    from llada_jax.params import HF_PREFIX

    stage_of = {f"{HF_PREFIX}blocks.{i}.{name}.weight": (i, name)
                for i in range(config.n_layers) for name, _, _ in layer_layout(config).entries}
    stage_of[HF_PREFIX + "ln_f.weight"] = (config.n_layers, "ln_f")
    stage_of[HF_PREFIX + "ff_out.weight"] = (config.n_layers, "lm_head")
    layouts = [layer_layout(config)] * config.n_layers + [head_layout(config)]
    pending: dict[int, dict] = {}
    packed: dict[int, np.ndarray] = {}
    embedding = None
    for name, array in tensors:
        if name == HF_PREFIX + "wte.weight":
            embedding = np.asarray(array, dtype)
            continue
        stage, short = stage_of[name]
        pending.setdefault(stage, {})[short] = array
        if len(pending[stage]) == len(layouts[stage].entries):
            packed[stage] = layouts[stage].pack(pending.pop(stage), dtype)
    return StagedWeights(embedding, tuple(packed[i] for i in range(config.n_layers)), packed[config.n_layers], dtype)


def kv_bytes(config: LLaDAConfig, batch: int, slots: int, itemsize: int) -> int:
    return 2 * config.n_layers * batch * slots * config.n_kv_heads * config.head_dim * itemsize


def ring_slots(budget: int, weights: StagedWeights, kv: int) -> int:
    """How many staging slots fit next to the KV state; at least one, else a clear error."""
    slots = (budget - kv) // weights.slot_bytes
    if slots < 1:
        raise LladaError(f"device memory budget {budget} bytes is too small: one staged layer ({weights.slot_bytes} "
                         f"bytes) plus the KV state ({kv} bytes) need at least {weights.slot_bytes + kv} bytes")
    return int(min(slots, len(weights.stages)))


@dataclasses.dataclass
class StagingStats:
    bytes_staged: int = 0
    copy_seconds: float = 0.0     # spent by the copy thread
    compute_seconds: float = 0.0  # spent computing stages
    wait_seconds: float = 0.0     # compute stalled waiting for a copy

    @property
    def hidden_fraction(self) -> float:
        """Share of copy time overlapped by compute."""
        if self.copy_seconds == 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.copy_seconds)

    def as_dict(self) -> dict:
        return {"bytes_staged": self.bytes_staged, "copy_seconds": self.copy_seconds,
                "compute_seconds": self.compute_seconds, "hidden_fraction": self.hidden_fraction}


class StagingRing:
    """N reusable device slots streaming a fixed sequence of host stages, copies overlapped with compute.

    `upload(slot, host)` fills a slot and returns what compute reads (a device buffer).
    Invariant: stage i lives in slot i mod N; its copy starts only after stage i - N finished computing.
    """

    def __init__(self, stages: tuple[np.ndarray, ...], slots: int, upload: Callable, stats: StagingStats):
        self.stages, self.slots, self.upload, self.stats = stages, slots, upload, stats

    def run(self, compute: Callable[[int, object], None]) -> None:
        count = len(self.stages)
        jobs: queue.Queue = queue.Queue()
        ready = [threading.Event() for _ in range(count)]
        loaded: list = [None] * count
        failure: list = []

        def copier():
            while (stage := jobs.get()) is not None:
                try:
                    started = time.perf_counter()
                    loaded[stage] = self.upload(stage % self.slots, self.stages[stage])
                    self.stats.copy_seconds += time.perf_counter() - started
                    self.stats.bytes_staged += self.stages[stage].nbytes
                except BaseException as err:  # surfaced in the computing thread
                    failure.append(err)
                ready[stage].set()

        thread = threading.Thread(target=copier, daemon=True)
        thread.start()
        try:
            for stage in range(min(self.slots, count)):
                jobs.put(stage)
            for stage in range(count):
                started = time.perf_counter()
                ready[stage].wait()
                self.stats.wait_seconds += time.perf_counter() - started
                if failure:
                    raise failure[0]
                started = time.perf_counter()
                compute(stage, loaded[stage])
                self.stats.compute_seconds += time.perf_counter() - started
                loaded[stage] = None
                if stage + self.slots < count:
                    jobs.put(stage + self.slots)
        finally:
            jobs.put(None)
            thread.join()
