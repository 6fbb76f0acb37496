"""Live view of the canvas denoising on a terminal: masks fill in step by step."""

from __future__ import annotations

import dataclasses
import sys

MASK_GLYPH = "\u2591"   # light shade block for a still-masked position
CLEAR = "\x1b[2J\x1b[H"


@dataclasses.dataclass
class LiveCanvas:
    """`on_step` callback for `generate`: redraws the generated part of the canvas after each step."""

    tokenizer: object | None
    stream: object = sys.stderr

    def piece(self, token_id: int, mask_id: int) -> str:
        if token_id == mask_id:
            return MASK_GLYPH
        if self.tokenizer is None:
            return f"{token_id} "
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def __call__(self, canvas, record) -> None:
        generated = canvas.tokens[0, canvas.prompt_len: canvas.length]
        text = "".join(self.piece(int(t), canvas.mask_id) for t in generated)
        masked = int((generated == canvas.mask_id).sum())
        self.stream.write(f"{CLEAR}step {record.nfe + 1} (block {record.block + 1}, {record.kind}) "
                          f"masked {masked}/{len(generated)}\n\n{text}\n")
        self.stream.flush()
