"""Dream and LLaDA-MoE behind the user-facing front ends: `llada serve` (the official `openai` client, streams
running together) and the lm-evaluation-harness adapter answer as `generate` alone does on the same checkpoint,
with each family's own decoding defaults. The checkpoints are random, in the family's HF layout, over the
embedded model's tokenizer."""

from __future__ import annotations

import dataclasses
import shutil
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest

import llada_jax
from eval.lm_harness import LladaLM
from eval.mc_likelihood import greedy_matches, mc_log_likelihood, request_rng
from llada_jax.system.locations import EMBEDDED_DIR
from tests.conftest import write_checkpoint
from tests.test_families import CONFIGS
from tests.test_server import NAME, QUESTIONS, alone, serving

pytestmark = pytest.mark.slow  # servers and harness runs: the full tier only

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family_chat_model(request, tmp_path_factory):
    """A family checkpoint sized to the embedded tokenizer (its vocabulary, mask and end-of-text ids)."""
    embedded = llada_jax.load(EMBEDDED_DIR).config
    config = dataclasses.replace(CONFIGS[request.param], vocab_size=embedded.vocab_size,
                                 embedding_size=embedded.embedding_size, mask_token_id=embedded.mask_token_id,
                                 eos_token_id=embedded.eos_token_id, eot_token_id=embedded.eot_token_id)
    path = write_checkpoint(tmp_path_factory.mktemp("chat") / request.param, config, std=0.3)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_DIR / name, path / name)
    model = llada_jax.load(path)
    assert model.config.family == config.family and model.tokenizer is not None
    return path, model


def test_concurrent_streams_answer_as_generate_alone(family_chat_model):
    _, model = family_chat_model
    with serving(model) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

        def ask(question: str) -> str:
            chunks = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                                    stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, QUESTIONS[:3]))
    assert answers == [alone(model, question) for question in QUESTIONS[:3]]


def test_lm_eval_adapter_answers_and_scores_as_the_model(family_chat_model):
    path, model = family_chat_model
    lm = LladaLM(pretrained=str(path), batch_size=2, block_length=8, policy="dual-cache@0.9", mc_num=4,
                 mc_batch_size=4, seed=7)
    tokenizer = model.tokenizer
    prompts = [tokenizer.chat_prompt(question) for question in QUESTIONS[:2]]
    answers = lm.generate_until([SimpleNamespace(args=(prompt, {"max_gen_toks": 30})) for prompt in prompts])
    assert answers == [alone(model, question, policy="dual-cache", threshold=0.9) for question in QUESTIONS[:2]]
    context, continuation = prompts[0], "1 2"
    (score, greedy), = lm.loglikelihood([SimpleNamespace(args=(context, continuation))])
    prefix, target = lm.encode_pair(context, continuation)
    rng = request_rng(7, context, continuation)
    assert score == pytest.approx(mc_log_likelihood(model, prefix, target, 4, 4, rng), abs=1e-5)
    assert greedy == greedy_matches(model, prefix, target, 0.0)
