"""The shipped model: loads through the standard path and still solves its held-out tasks."""

from __future__ import annotations

import numpy as np
import pytest

import llada_jax
from llada_jax.system.locations import default_model_dir
from llada_jax.training.tasks import held_out
from llada_jax.weights.tokenizer import answer_text


@pytest.fixture(scope="module")
def embedded():
    return llada_jax.load(default_model_dir())


def test_embedded_model_is_a_small_llada_in_hf_layout(embedded):
    config, tokenizer = embedded.config, embedded.tokenizer
    assert config.mask_token_id == tokenizer.token_id("<|mdm_mask|>")
    assert config.eos_token_id == tokenizer.token_id("<|endoftext|>")
    assert config.eot_token_id == tokenizer.token_id("<|eot_id|>")
    assert sum((default_model_dir() / name).stat().st_size for name in
               ("model.safetensors", "tokenizer.json", "config.json")) < 20 * 2**20
    prompt = tokenizer.chat_prompt("sort 3 1 2")
    assert prompt.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nsort 3 1 2<|eot_id|>")


@pytest.mark.parametrize("policy, threshold", [("vanilla", None), ("dual-cache+speculative", 0.9)])
@pytest.mark.slow
def test_embedded_model_solves_held_out_tasks(embedded, policy, threshold):
    examples = held_out(5)
    solved = 0
    for example in examples:
        ids = np.array(embedded.tokenizer.encode(embedded.tokenizer.chat_prompt(example.prompt)))
        result = llada_jax.generate(embedded, ids, gen_length=32, block_length=8, steps=32, policy=policy,
                                    threshold=threshold)
        solved += answer_text(embedded.tokenizer, result.output_ids, embedded.config) == example.answer
    assert solved >= 16, f"{solved}/20 held-out answers exact"  # the shipped model scores ~93% here
