"""The host-side canvas of one generation and the windows a step computes over it."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from llada_jax.model.shapes import bucket


class Block(NamedTuple):
    index: int
    start: int  # first canvas position of the block
    end: int    # one past the last


class Window(NamedTuple):
    """The canvas positions a step computed: `positions[i]` is real where `valid[i]` (padding otherwise)."""

    positions: np.ndarray  # [W] int
    valid: np.ndarray      # [W] bool

    def columns(self, reads: tuple[int, ...] | None) -> "Window":
        """The part of the window in the columns `reads`; None: all of it."""
        if reads is None:
            return self
        return Window(self.positions[list(reads)], self.valid[list(reads)])


@dataclasses.dataclass
class Canvas:
    """Token rows `[B, S]`: row 0 is the canvas; under CFG row 1 is the same with the prompt masked.

    Columns are canvas positions. The first `offset` columns are left padding (a batch aligns its rows'
    answers by it, as LLaDA's reference does) and columns >= `length` are padding up to the shape bucket
    S: both are hidden from attention. The prompt fills [offset, prompt_len), the answer
    [prompt_len, length); a column's rotary position is `column - offset`, as if unpadded.
    """

    tokens: np.ndarray
    length: int
    prompt_len: int
    mask_id: int
    offset: int = 0

    @classmethod
    def start(cls, prompt_ids: np.ndarray, gen_length: int, mask_id: int, cfg: bool, max_len: int,
              offset: int = 0) -> "Canvas":
        prompt_len = offset + len(prompt_ids)
        length = prompt_len + gen_length
        padded = bucket(length, max_len)
        rows = np.full((2 if cfg else 1, padded), mask_id, np.int32)
        rows[0, offset:prompt_len] = prompt_ids
        return cls(rows, length, prompt_len, mask_id, offset)

    @property
    def padded_length(self) -> int:
        """S: the canvas length rounded up to its shape bucket."""
        return self.tokens.shape[1]

    @property
    def valid(self) -> np.ndarray:
        """[B, S]: real canvas positions."""
        columns = np.arange(self.padded_length)
        return np.broadcast_to((columns >= self.offset) & (columns < self.length), self.tokens.shape)

    def rotary_positions(self, columns: np.ndarray) -> np.ndarray:
        """The positions the model sees at these columns: as in the unpadded canvas (0 on left padding)."""
        return np.maximum(np.asarray(columns) - self.offset, 0)

    @property
    def masked(self) -> np.ndarray:
        """[S]: positions of row 0 still holding the mask token (prompt and padding excluded)."""
        masked = self.tokens[0] == self.mask_id
        masked[: self.prompt_len] = False
        masked[self.length:] = False
        return masked

    def write(self, positions: np.ndarray, tokens: np.ndarray) -> None:
        """Commit `tokens` at generated `positions` (in every row)."""
        self.tokens[:, positions] = tokens

    def generated(self) -> np.ndarray:
        return self.tokens[0, self.prompt_len: self.length].astype(np.int64)

    def window(self, positions, width: int | None = None) -> Window:
        """These positions, padded to `width` (default: a shape bucket no wider than the canvas)."""
        positions = np.asarray(positions, np.int64)
        width = width or bucket(len(positions), self.padded_length)
        padded = np.zeros(width, np.int64)
        padded[: len(positions)] = positions
        return Window(padded, np.arange(width) < len(positions))

    def full_window(self) -> Window:
        return Window(np.arange(self.padded_length), self.valid[0])
