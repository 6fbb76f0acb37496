"""Which prompts fit the model's context with the answer, decided for the whole run before its first step: a
benchmark that stops at problem 5 on a prompt that was too long from the start wastes the four answers before
it. Too long prompts are refused in one line, or (`skip`) recorded as skipped rows with the reason."""

from __future__ import annotations

from llada_jax.system.errors import LladaError
from policies.generation import canvas_length


def too_long(model, prompts: dict[int, str], gen_length: int, block_length: int) -> dict[int, tuple[int, int]]:
    """index -> (prompt tokens, canvas length) of each prompt whose canvas exceeds the model's context (a
    block-diffusion canvas: rounded up to whole blocks). A prompt the vocabulary cannot encode is left to
    generation, which records it as an error row."""
    limit, over = model.config.max_sequence_length, {}
    blocks = block_length if model.config.block_causal else None
    for index, text in prompts.items():
        try:
            length = len(model.tokenizer.encode(text))
        except LladaError:
            continue
        if canvas_length(length, gen_length, blocks) > limit:
            over[index] = (length, canvas_length(length, gen_length, blocks))
    return over


def skipped_reasons(model, prompts: dict[int, str], decoding: dict, skip: bool, total: int) -> dict[int, str]:
    """index -> why it is skipped, for each prompt of `prompts` that does not fit (`skip`); without `skip`, any
    such prompt refuses the run, naming how many of the run's `total` problems do not fit and what would fit."""
    limit, gen_length = model.config.max_sequence_length, decoding["gen_length"]
    over = too_long(model, prompts, gen_length, decoding["block_length"])
    if over and not skip:
        longest, canvas = max(over.values())
        room = limit - longest
        shorter = f"--gen-length {room} or less fits them all, or " if room > 0 else ""
        raise LladaError(f"{len(over)} of {total} problems do not fit the model's context: the longest prompt "
                         f"({longest}) + gen_length ({gen_length}) = {canvas} exceeds max_sequence_length={limit}; "
                         f"{shorter}--skip-too-long records them as skipped")
    return {index: f"prompt ({length}) + gen_length ({gen_length}) = {canvas} exceeds max_sequence_length={limit}"
            for index, (length, canvas) in over.items()}
