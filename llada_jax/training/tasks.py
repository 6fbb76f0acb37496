"""The embedded model's task suite: deterministic generators, a held-out split, exact-match scoring.

Every answer depends on the prompt's content (not just its format) and is at least 17 characters,
so with the character-level tokenizer it spans at least three blocks of 8 tokens.
"""

from __future__ import annotations

import dataclasses
import random
import string
from typing import Callable, Iterator

from llada_jax.system.errors import LladaError

MIN_ANSWER = 17
HELD_OUT_SEED = 2_000_003
HELD_OUT_PER_FAMILY = 100
MAX_HELD_OUT_PER_FAMILY = 100_000


@dataclasses.dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    answer: str


def sort_digits(rng: random.Random) -> Example:
    digits = [rng.randrange(10) for _ in range(rng.randint(9, 12))]
    return Example("sort", "sort " + " ".join(map(str, digits)), " ".join(map(str, sorted(digits))))


def reverse_letters(rng: random.Random) -> Example:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(17, 22)))
    return Example("reverse", "reverse " + word, word[::-1])


def shift_letters(rng: random.Random) -> Example:
    """Caesar shift: each letter moves `k` places along the alphabet, wrapping."""
    k = rng.randint(1, 3)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(17, 22)))
    shifted = "".join(chr((ord(c) - 97 + k) % 26 + 97) for c in word)
    return Example("shift", f"shift {k} {word}", shifted)


NAMES = ("Ann", "Bob", "Cy", "Dee", "Eli", "Fay", "Gus", "Ida")
ITEMS = ("pens", "cups", "eggs", "hats", "maps", "nuts", "pins", "toys")


def word_problem(rng: random.Random) -> Example:
    """Two steps (add then subtract, or subtract then add), answered GSM8K-style with `#### N`."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, first, second = rng.randint(10, 60), rng.randint(10, 40), rng.randint(2, 9)
    if rng.random() < 0.5:
        middle, final = start + first, start + first - second
        prompt = f"{name} has {start} {item}, gets {first}, loses {second}. How many?"
        answer = f"{start}+{first}={middle}. {middle}-{second}={final}. #### {final}"
    else:
        middle, final = start - second, start - second + first
        prompt = f"{name} has {start} {item}, loses {second}, gets {first}. How many?"
        answer = f"{start}-{second}={middle}. {middle}+{first}={final}. #### {final}"
    return Example("word", prompt, answer)


FAMILIES: dict[str, Callable[[random.Random], Example]] = {
    "sort": sort_digits,
    "reverse": reverse_letters,
    "shift": shift_letters,
    "word": word_problem,
}


def held_out(per_family: int = HELD_OUT_PER_FAMILY) -> list[Example]:
    """The fixed evaluation split: the first distinct examples of each family from a reserved seed."""
    if not 0 < per_family <= MAX_HELD_OUT_PER_FAMILY:  # a family's distinct prompts are finite (the fewest: 1.6M)
        raise LladaError(f"--limit must be a number of examples per family in [1, {MAX_HELD_OUT_PER_FAMILY}], "
                         f"got {per_family}")
    examples = []
    for offset, (_, make) in enumerate(sorted(FAMILIES.items())):
        rng = random.Random(HELD_OUT_SEED + offset)
        seen: set[str] = set()
        while len(seen) < per_family:
            example = make(rng)
            if example.prompt not in seen:
                seen.add(example.prompt)
                examples.append(example)
    return examples


def training_examples(rng: random.Random, excluded: set[str]) -> Iterator[Example]:
    """An endless stream over all families, drawn from `rng`, that never yields an `excluded` prompt."""
    makers = [FAMILIES[name] for name in sorted(FAMILIES)]
    while True:
        example = rng.choice(makers)(rng)
        if example.prompt not in excluded:
            yield example


def exact_match(output: str, answer: str) -> bool:
    return output.strip() == answer
