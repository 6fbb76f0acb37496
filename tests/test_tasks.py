"""The task suite: deterministic, long enough answers, and a held-out split training never sees."""

from __future__ import annotations

import itertools
import random

import pytest

from llada_jax.system.errors import LladaError
from llada_jax.training.tasks import FAMILIES, MAX_HELD_OUT_PER_FAMILY, MIN_ANSWER, held_out, training_examples


def test_generators_are_deterministic_and_answers_span_three_blocks():
    first, second = held_out(20), held_out(20)
    assert first == second
    assert {e.family for e in first} == set(FAMILIES) and len(first) == 20 * len(FAMILIES)
    assert all(len(e.answer) >= MIN_ANSWER for e in first)


def test_answers_depend_on_the_prompt():
    examples = held_out(30)
    for family in FAMILIES:
        answers = {e.answer for e in examples if e.family == family}
        assert len(answers) >= 25


def test_training_stream_never_yields_a_held_out_prompt():
    excluded = {e.prompt for e in held_out()}
    drawn = list(itertools.islice(training_examples(random.Random(0), excluded), 5000))
    assert not any(e.prompt in excluded for e in drawn)
    # the filter itself: excluding the first draws of a seed removes exactly those from that seed's stream
    first = [e.prompt for e in itertools.islice(training_examples(random.Random(1), set()), 50)]
    refiltered = [e.prompt for e in itertools.islice(training_examples(random.Random(1), set(first[:10])), 40)]
    assert refiltered == first[10:50]


def test_word_problem_answers_end_with_the_number():
    for e in held_out(30):
        if e.family == "word":
            steps = e.answer.split(". ")
            assert steps[-1].startswith("#### ") and steps[1].split("=")[1] == steps[-1][5:]


@pytest.mark.parametrize("limit", [0, -1, MAX_HELD_OUT_PER_FAMILY + 1, 10**7])
def test_a_limit_outside_what_the_families_hold_is_refused_not_searched_forever(limit):
    with pytest.raises(LladaError, match=rf"--limit must be a number of examples per family in \[1, 100000\], "
                                         rf"got {limit}"):
        held_out(limit)
