"""The one seam between decoding and execution: what every backend (XLA or IREE, resident or staged)
offers. Decoders and policies call these methods and never know what runs them.

A step returns a readout on the host and proposed K/V on the device; nothing is written into the KV
state until `commit`, which returns a new state. Optional capabilities are explicit methods whose
defaults say "not offered".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, NamedTuple, Protocol

import numpy as np

from llada_jax.model.kv_state import KVState
from llada_jax.model.readout import ReadoutSpec, Reads, StepOutput, TokenBiases


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendRequest:
    """What a generation asks of the backend that will run it: the readout its decoder uses, and the rows and
    canvas positions a step takes (a backend sizes its device memory by them before any step runs)."""

    readout_spec: ReadoutSpec
    biases: TokenBiases
    rows: int                # canvas rows per step: a batch, 2 per prompt under CFG
    slots: int               # canvas positions
    cfg_scale: float = 0.0
    block_length: int | None = None  # block diffusion's blocks: the width of every window its decoder asks for


@dataclasses.dataclass(frozen=True)
class BackendCall:
    """One step call a decoder asks for: the host loop yields these (`policies.loop.decode_steps`) and whoever
    drives it runs them, alone or stacked with other generations' calls (`policies.step_batcher`)."""

    method: Literal["full", "window", "commit"]
    args: tuple
    blocks: np.ndarray | None = None  # a window of several diffusion blocks: each position's block `[B, W]`

    def run(self, backend: "Backend"):
        keywords = {} if self.blocks is None else {"blocks": self.blocks}
        return getattr(backend, self.method)(*self.args, **keywords)


class SideBackend(NamedTuple):
    """Where the revision policy's side path runs, when not on the dense backend itself: another
    backend (a worker thread may drive it) and the conversions of K/V between the two."""

    backend: "Backend"
    to_side: Callable[[KVState], KVState]         # dense-path KV -> side arrays (a copy)
    to_dense: Callable[[StepOutput], StepOutput]  # side K/V -> dense-path arrays


class Backend(Protocol):
    """`reads` (start, width): the step's readout covers only its columns [start, start + width) (the
    positions whose prediction the decoder uses); None: every column. A backend may compute the LM head
    on those columns only."""

    def full(self, tokens: np.ndarray, valid: np.ndarray, reads: Reads | None = None) -> StepOutput:
        """The whole canvas `[B, S]`; `valid` marks real (non-padding) positions."""
        ...

    def window(self, state: KVState, visible: np.ndarray, window_ids: np.ndarray, window_pos: np.ndarray,
               window_valid: np.ndarray, reads: Reads | None = None, blocks: np.ndarray | None = None) -> StepOutput:
        """W positions `[B, W]` against the cached slots `visible` `[B, S]` and each other; with `blocks` `[B, W]`
        (each position's diffusion block: `block_windows`), a position sees no window position of a later block."""
        ...

    def commit(self, state: KVState, positions: np.ndarray, write: np.ndarray, out: StepOutput,
               tokens: np.ndarray, nfe: int) -> KVState:
        """A new state with `out`'s proposed K/V written at `positions` where `write`, recorded as
        computed from `tokens` by dense forward pass `nfe`."""
        ...

    def empty_state(self, batch: int, slots: int) -> KVState:
        """A KV state of `slots` positions holding nothing, on this backend's device."""
        ...

    def block_windows(self) -> bool:
        """Whether `window` takes `blocks` (block-causal attention inside one window)."""
        return False

    def side_backend(self) -> SideBackend | None:
        """Where revision's side path should run concurrently; None: inline on this backend."""
        return None

    def compiled_loop(self, spec) -> Callable | None:
        """The whole decode loop of `spec` (a `policies.loop_io.LoopSpec`) as one compiled call,
        `LoopInputs -> LoopOutputs` (numpy); None: this backend runs only the host loop."""
        return None

    def staging_stats(self) -> dict:
        """Weight-staging counters of this generation (bytes copied, hidden fraction, ...); {} if resident."""
        return {}

    # Batching (`policies.step_batcher`): rows of several generations stacked into one step.
    def batch_sizes(self) -> tuple[int, ...] | None:
        """The row counts a step can take (a bundle's compiled ones); None: any."""
        return None

    def join_rows(self, arrays: list, axis: int):
        """Device arrays (K/V) concatenated along their batch `axis`."""
        return np.concatenate([np.asarray(array) for array in arrays], axis=axis)

    def split_rows(self, array, parts: int, axis: int) -> list:
        """A device array cut into `parts` equal runs of rows along its batch `axis`."""
        return np.split(np.asarray(array), parts, axis=axis)
