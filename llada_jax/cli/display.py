"""Live view of the canvas denoising on a terminal: masks fill in step by step."""

from __future__ import annotations

import dataclasses
import sys
from typing import TextIO

import numpy as np

from llada_jax.weights.tokenizer import Tokenizer

MASK_GLYPH = "\u2591"   # light shade block for a still-masked position
CLEAR = "\x1b[2J\x1b[H"


@dataclasses.dataclass
class LiveCanvas:
    """`on_step` callback for `generate`: redraws the generated part of the canvas after each step.
    From the answer's first end token (`end_ids`: EOS, EoT) on, special tokens are not drawn: the
    answer is over, and LLaDA pads the rest of the canvas with them."""

    tokenizer: Tokenizer | None
    end_ids: tuple[int, ...] = ()
    stream: TextIO = sys.stderr

    def piece(self, token_id: int, mask_id: int, after_end: bool) -> str:
        if token_id == mask_id:
            return MASK_GLYPH
        if self.tokenizer is None:
            return "" if after_end and token_id in self.end_ids else f"{token_id} "
        return self.tokenizer.decode([token_id], skip_special_tokens=after_end)

    def __call__(self, canvas, record) -> None:
        generated = canvas.tokens[0, canvas.prompt_len: canvas.length]
        ends = np.flatnonzero(np.isin(generated, self.end_ids))
        first_end = ends[0] if ends.size else len(generated)
        text = "".join(self.piece(int(t), canvas.mask_id, i >= first_end) for i, t in enumerate(generated))
        masked = int((generated == canvas.mask_id).sum())
        self.stream.write(f"{CLEAR}step {record.nfe + 1} (block {record.block + 1}, {record.kind}) "
                          f"masked {masked}/{len(generated)}\n\n{text}\n")
        self.stream.flush()
