"""An answer's text as it settles, for streaming: a diffusion model commits tokens anywhere in its block,
so the text a client may see is the answer's longest committed prefix (no mask before it). Without
revision a committed token never changes, so that prefix is final; under revision committed tokens stay
revisable, so nothing settles before the generation ends.

The answer ends at the first EOS / EoT token, at the first stop sequence (the stop itself is not part
of the text), or after `limit` tokens (a request's `max_tokens`; the canvas holds whole blocks). Text that
could still turn into a stop sequence, or a character whose bytes are not all decoded yet, is held back
until it is known.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PARTIAL_CHARACTER = "\ufffd"  # what a byte-level decoder gives for a character cut in the middle


@dataclasses.dataclass(frozen=True)
class Settled:
    text: str                  # the answer's text so far (final text once finished)
    tokens: int                # answer tokens it covers (EOS / EoT excluded)
    finish_reason: str | None  # "stop" (EOS / EoT or a stop sequence), "length" (the canvas or the limit), or None


class SettledAnswer:
    """Tracks one answer; `update` gives the new text since the last call, once, in order."""

    def __init__(self, tokenizer, mask_id: int, end_ids: tuple[int, ...], stops: tuple[str, ...], revisable: bool,
                 limit: int | None = None):
        self.tokenizer, self.mask_id, self.end_ids = tokenizer, mask_id, tuple(end_ids)
        self.stops, self.revisable, self.limit = tuple(stops), revisable, limit
        self.sent = ""
        self.finished: Settled | None = None

    def settle(self, answer_ids: np.ndarray, final: bool) -> Settled:
        """What of `answer_ids` (the generated canvas, masks where uncommitted) is settled."""
        ids = [int(token) for token in answer_ids][: self.limit]
        if not final:
            ids = [] if self.revisable else ids[: ids.index(self.mask_id) if self.mask_id in ids else len(ids)]
        ended = next((index for index, token in enumerate(ids) if token in self.end_ids), None)
        if ended is not None:
            ids = ids[:ended]
        text = self.tokenizer.decode(ids)
        complete = final or ended is not None or len(ids) == self.limit
        held = text if complete else self._held_back(text)
        cut = min((at for at in (text.find(stop) for stop in self.stops) if at >= 0), default=None)
        # A stop found in unfinished text counts only if no longer stop could still begin before it.
        if cut is not None and cut <= len(held):
            return Settled(text[:cut], self._tokens_of(ids, text[:cut]), "stop")
        if complete:
            return Settled(text, len(ids), "stop" if ended is not None else "length")
        return Settled(held, len(ids), None)

    def update(self, answer_ids: np.ndarray, final: bool = False) -> tuple[str, Settled]:
        """(the text settled since the last update, the settled state)."""
        if self.finished is not None:
            return "", self.finished
        settled = self.settle(answer_ids, final)
        if settled.finish_reason is not None:
            self.finished = settled
        if not settled.text.startswith(self.sent):  # a decoder that re-spells a prefix: wait for the end
            return "", settled
        delta, self.sent = settled.text[len(self.sent):], settled.text
        return delta, settled

    def _held_back(self, text: str) -> str:
        """`text` without a cut character at its end and without any end that could begin a stop sequence."""
        text = text.rstrip(PARTIAL_CHARACTER)
        hold = max((size for stop in self.stops for size in range(1, len(stop)) if text.endswith(stop[:size])),
                   default=0)
        return text[: len(text) - hold]

    def _tokens_of(self, ids: list[int], text: str) -> int:
        """The fewest leading tokens of `ids` whose text covers `text` (the answer cut at a stop sequence)."""
        for count in range(len(ids) + 1):
            if len(self.tokenizer.decode(ids[:count])) >= len(text):
                return count
        return len(ids)
