"""The compiled block-diffusion loop (`policies.block_loop`) from the decoding side: which settings it covers,
its static spec, inputs and outputs, and the host loop's `Result` rebuilt from them. No JAX here.

It covers the cached decoders of LLaDA2.0 and LLaDA2.1 (with speculation's drafts) at temperature 0; the
uncached twin (`vanilla`) and sampling stay on the host loop (`policies.block_diffusion`). Its trace holds,
per forward pass, what the window wrote (commits and drafts) and what 2.1's editing replaced, so the host
loop's `StepRecord`s come back whole.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from llada_jax.model.arrays import Array
from llada_jax.system.errors import LladaError
from policies.block_diffusion import BlockSettings, pass_bound
from policies.compiled_loop import call_loop
from policies.loop import Result, StepRecord
from policies.loop_io import log_cutoff
from policies.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class BlockLoopSpec:
    """The static structure of one compiled block-diffusion loop (hashable: a static argument of the jitted
    loop). Thresholds are inputs, not part of it."""

    gen_length: int
    block_length: int
    shares: tuple[int, ...]   # 2.0: commits per step of a block (the even split); () under 2.1
    editing: bool             # LLaDA2.1's decoder
    max_post_steps: int
    num_to_transfer: int
    lookahead: int            # following blocks drafted in each pass's window
    passes_per_block: int     # a block's passes at most (2.1: the bound that stops a loop without end)
    slots: int                # canvas positions: the prompt plus gen_length, in whole blocks, fit

    @property
    def caches(self) -> bool:
        """Always: finished blocks' K/V are cached (the uncached `vanilla` runs on the host loop only)."""
        return True

    @property
    def read_width(self) -> int:
        """Window rows read out per pass: the current block and its drafts."""
        return self.block_length * (1 + self.lookahead)

    @property
    def max_passes(self) -> int:
        """Forward passes at most: the blocks holding answer positions, each its passes at most."""
        blocks = -(-self.gen_length // self.block_length) + 1  # the prompt's last partial block may be one
        return blocks * self.passes_per_block

    @property
    def name(self) -> str:
        """The compiled function's name: the setting and shape in a symbol-safe form."""
        rule = f"edit{self.max_post_steps}t{self.num_to_transfer}" if self.editing else f"n{len(self.shares)}"
        return (f"blockloop_{rule}_la{self.lookahead}_g{self.gen_length}_b{self.block_length}_s{self.slots}")

    def manifest(self) -> dict:
        """What a bundle's manifest records of the loop: its fields."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BakedBlockLoops:
    """A block-diffusion decoding setting compiled into a bundle: one loop per canvas size, and its settings
    (the thresholds are runtime inputs of the loop, baked into the bundle's run.sh)."""

    settings: BlockSettings
    specs: tuple[BlockLoopSpec, ...]

    @property
    def setting(self) -> str:
        """The decoder, as `--policy` and the block flags name it."""
        settings = self.settings
        drafts = f"+speculative:{settings.lookahead}:{settings.draft_threshold}" if settings.lookahead else ""
        rule = "" if settings.threshold is None else f"@{settings.threshold}"
        edits = "" if settings.editing_threshold is None else f", --editing-threshold {settings.editing_threshold}"
        return f"dual-cache{drafts}{rule}{edits}"

    def manifest(self) -> dict:
        """What a bundle's manifest records of the setting: its settings and the loop's cutoff inputs (null: none,
        an infinite cutoff; JSON has no infinity)."""
        return {"setting": self.setting, **dataclasses.asdict(self.settings),
                **{name: float(value) if np.isfinite(value) else None
                   for name, value in block_cutoffs(self.settings).items()}}


def baked_block_loops(settings: BlockSettings, slot_sizes) -> BakedBlockLoops:
    """The compiled loops a bundle needs to run this setting: one per canvas size that holds a prompt and the
    answer in whole blocks. A setting only the host loop runs is a one-line error."""
    sizes = [size for size in sorted(set(slot_sizes)) if size >= settings.canvas_length(1)]
    if not sizes:
        raise LladaError(f"gen_length={settings.gen_length} in blocks of {settings.block_length} leaves no room for a "
                         f"prompt in canvases of at most {max(slot_sizes)} positions (raise --max-len)")
    specs = [block_loop_spec(settings, Sampler(), size) for size in sizes]
    covered = tuple(spec for spec in specs if spec is not None)
    if len(covered) < len(specs):
        raise LladaError("block diffusion's vanilla decoder runs only on the host loop: the compiled loop covers "
                         "its cached ones (--policy dual-cache, the default)")
    return BakedBlockLoops(settings, covered)


def block_loop_spec(settings: BlockSettings, sampler: Sampler, slots: int) -> BlockLoopSpec | None:
    """The compiled loop of this setting, or None where only the host loop runs it (uncached, sampling)."""
    if not settings.cached or sampler.temperature != 0.0:
        return None
    editing = settings.editing_threshold is not None
    shares = () if editing else tuple(int(share) for share in settings.shares())
    return BlockLoopSpec(settings.gen_length, settings.block_length, shares, editing, settings.max_post_steps,
                         settings.num_to_transfer, settings.lookahead,
                         pass_bound(settings) if editing else len(shares), slots)


class BlockLoopInputs(NamedTuple):
    """The loop's runtime inputs, in call order (weights come first, bound by the backend)."""

    prompt: Array         # [slots] int32: the prompt, then anything
    prompt_len: Array     # [] int32
    commit_cutoff: Array  # [] float32: a mask commits at log p >= this (probability > threshold; +inf: none)
    edit_cutoff: Array    # [] float32: 2.1's edit at log p >= this (probability > editing_threshold)
    draft_cutoff: Array   # [] float32: a draft commits at log p >= this (probability >= draft_threshold)


class BlockLoopOutputs(NamedTuple):
    """The loop's outputs, in return order; per-pass arrays have `max_passes` rows, the first `nfe` used."""

    generated: Array      # [gen_length] int32
    nfe: Array            # [] int32: denoising passes
    cache_passes: Array   # [] int32: passes that only cached a finished block
    bounded_blocks: Array  # [] int32: 2.1 blocks stopped by the bound
    pass_block: Array     # [P] int32: the block a pass denoised
    pass_width: Array     # [P] int32: positions it computed (a pending finished block included)
    pass_rows: Array      # [P] int32: rows it read out (the block and the drafts that fit the canvas)
    written: Array        # [P, R] bool: rows committed (the block's, then drafts)
    x0: Array             # [P, R] int32: each row's prediction
    logp: Array           # [P, R] float32: its log-probability
    edited: Array         # [P, block_length] bool: 2.1's replacements
    old: Array            # [P, block_length] int32: the block's tokens before the pass
    bad_pass: Array       # [] int32: the pass whose readout was not finite, else NOT_COMMITTED
    bad_position: Array   # [] int32: its first such canvas position


def block_cutoffs(settings: BlockSettings) -> dict[str, np.ndarray]:
    """The loop's cutoff inputs of `settings` (+inf: none passes), by `BlockLoopInputs` field."""
    def strict(threshold):
        return np.float32(np.inf) if threshold is None else log_cutoff(threshold, strict=True)

    return {"commit_cutoff": np.asarray(strict(settings.threshold), np.float32),
            "edit_cutoff": np.asarray(strict(settings.editing_threshold), np.float32),
            "draft_cutoff": np.asarray(log_cutoff(settings.draft_threshold), np.float32)}


def block_loop_inputs(prompt: np.ndarray, spec: BlockLoopSpec, settings: BlockSettings) -> BlockLoopInputs:
    padded = np.zeros(spec.slots, np.int32)
    padded[: len(prompt)] = prompt
    return BlockLoopInputs(padded, np.asarray(len(prompt), np.int32), **block_cutoffs(settings))


def block_result(outputs: BlockLoopOutputs, spec: BlockLoopSpec, prompt_len: int, canvas_length: int) -> Result:
    """The `Result` the host loop returns on a backend that folds finished blocks (XLA)."""
    trace = tuple(_record(outputs, spec, n) for n in range(int(outputs.nfe)))
    stats = {"cache_passes": int(outputs.cache_passes), "canvas_length": canvas_length, "loop": "compiled"}
    if spec.editing:
        stats["bounded_blocks"] = int(outputs.bounded_blocks)
    return Result(np.asarray(outputs.generated, np.int64), len(trace), 0.0, trace, prompt_len, stats)


def _record(outputs: BlockLoopOutputs, spec: BlockLoopSpec, n: int) -> StepRecord:
    block, width, rows = (int(outputs.pass_block[n]), int(outputs.pass_width[n]), int(outputs.pass_rows[n]))
    lo = block * spec.block_length
    written = np.asarray(outputs.written[n, :rows], bool)
    x0 = np.asarray(outputs.x0[n, :rows], np.int64)
    confidence = np.exp(np.asarray(outputs.logp[n, :rows], np.float64))
    edited = np.flatnonzero(outputs.edited[n])
    revisions = tuple((lo + int(i), int(outputs.old[n, i]), int(x0[i])) for i in edited)
    return StepRecord(nfe=n, block=block, kind="window", width=width, shape_width=width, useful=rows,
                      positions=tuple(int(p) for p in lo + np.flatnonzero(written)),
                      tokens=tuple(int(t) for t in x0[written]),
                      confidence=tuple(float(c) for c in confidence[written]),
                      drafts=int(written[spec.block_length:].sum()), revisions=revisions)


def run_block_loop(compiled, prompt: np.ndarray, spec: BlockLoopSpec, settings: BlockSettings) -> Result:
    """One generation through a backend's compiled block loop."""
    return call_loop(compiled, lambda: block_loop_inputs(prompt, spec, settings),
                     lambda outputs: block_result(outputs, spec, len(prompt), settings.canvas_length(len(prompt))))
