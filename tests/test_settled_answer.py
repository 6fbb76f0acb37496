"""Streaming text as it settles: whatever order tokens are committed in, the pieces streamed add up to the
final answer, which is the decoded answer cut to the tokens asked for, at its first EOS / EoT and then at its
first stop sequence; under revision nothing is streamed before the end."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from llada_jax.model.config import read_config
from llada_jax.server.answer import SettledAnswer
from llada_jax.server.requests import end_ids
from llada_jax.system.locations import EMBEDDED_DIR
from llada_jax.weights.tokenizer import eot_id_from_files, load_tokenizer

TOKENIZER, CONFIG = load_tokenizer(EMBEDDED_DIR), read_config(EMBEDDED_DIR, eot_id_from_files(EMBEDDED_DIR))
ENDS = end_ids(CONFIG)
WORDS = [CONFIG.eos_token_id, CONFIG.eot_token_id] + list(range(8, 40))


def reference(ids: list[int], stops: tuple[str, ...], limit: int | None = None) -> tuple[str, str]:
    """(text, finish reason) computed plainly from the whole answer."""
    ids = ids[:limit]
    ended = next((index for index, token in enumerate(ids) if token in ENDS), None)
    text = TOKENIZER.decode(ids if ended is None else ids[:ended])
    cuts = [text.find(stop) for stop in stops if stop in text]
    if cuts:
        return text[: min(cuts)], "stop"
    return text, "stop" if ended is not None else "length"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.sampled_from(WORDS), min_size=1, max_size=24), data=st.data(), revisable=st.booleans(),
       limit=st.none() | st.integers(1, 24))
def test_streamed_pieces_add_up_to_the_answer(ids, data, revisable, limit):
    order = data.draw(st.permutations(range(len(ids))))
    text = TOKENIZER.decode(ids)
    stops = tuple(data.draw(st.lists(st.sampled_from([text[i:j] for i in range(len(text))
                                                      for j in range(i + 1, min(len(text), i + 4) + 1)] or ["zz"]),
                                     max_size=2)))
    answer = SettledAnswer(TOKENIZER, CONFIG.mask_token_id, ENDS, stops, revisable, limit)
    canvas = np.full(len(ids), CONFIG.mask_token_id)
    streamed = ""
    for position in order:  # commit one token at a time, in the drawn order
        canvas[position] = ids[position]
        delta, settled = answer.update(canvas, final=False)
        streamed += delta
        assert not (revisable and delta)
        if settled.finish_reason is not None:
            break
    delta, settled = answer.update(canvas, final=True)
    streamed += delta
    assert (streamed, settled.finish_reason) == reference(ids, stops, limit)
    assert TOKENIZER.decode(ids[: settled.tokens]).startswith(streamed)
    assert settled.tokens <= (limit or len(ids))


def test_a_stop_found_early_waits_for_a_longer_one_that_could_begin_before_it():
    """' \\n' holds the stop '\\n' at 1, but ' \\n ' (a stop beginning at 0) may still complete: streaming
    ' ' then would contradict the final answer '' (found by the property test above)."""
    ids, stops = [8, 9, 8, 8, CONFIG.eos_token_id], (" \n ", "\n")
    assert TOKENIZER.decode(ids[:3]) == " \n "
    answer = SettledAnswer(TOKENIZER, CONFIG.mask_token_id, ENDS, stops, False)
    canvas = np.full(len(ids), CONFIG.mask_token_id)
    canvas[:2] = ids[:2]
    assert answer.update(canvas) == ("", answer.settle(canvas, final=False))
    assert answer.settle(canvas, final=False).finish_reason is None
    canvas[2] = ids[2]
    delta, settled = answer.update(canvas)
    assert (delta, settled.text, settled.finish_reason) == ("", "", "stop") == ("", *reference(ids, stops))
