"""The lm-evaluation-harness adapter on the embedded model and the local tasks: lm-eval's own command line
end to end, `generate_until` answers equal to `generate` alone (batched, cut at stop strings), and the
Monte Carlo log-likelihood against plain computations."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from eval.lm_harness import LladaLM
from eval.mc_likelihood import mask_counts, masked_copies, mc_log_likelihood
from llada_jax.system.errors import LladaError
from llada_jax.training.tasks import held_out
from llada_jax.weights.tokenizer import answer_text

pytestmark = pytest.mark.slow  # IREE compiles or child processes: the full tier only

MASK = 5


@pytest.fixture(scope="module")
def lm():
    return LladaLM(batch_size=3, block_length=8, policy="dual-cache@0.9", mc_num=8, mc_batch_size=4)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


@settings(max_examples=100, deadline=None)
@given(length=st.integers(1, 40), rows=st.integers(1, 40), prefix=st.integers(0, 5), seed=st.integers(0, 10**6))
def test_masked_copies_cover_every_ratio(length, rows, prefix, seed):
    rng = np.random.default_rng(seed)
    counts = mask_counts(rng, length, rows)
    assert counts.min() >= 1 and counts.max() <= length
    if rows == length:
        assert sorted(counts.tolist()) == list(range(1, length + 1))
    sequence = np.arange(10, 10 + prefix + length)
    copies = masked_copies(rng, sequence, prefix, counts, MASK)
    assert ((copies == MASK).sum(1) == counts).all()
    assert (copies[:, :prefix] == sequence[:prefix]).all()
    assert ((copies == sequence) | (copies == MASK)).all()


def test_one_token_likelihood_is_the_masked_prediction(lm):
    """A one-token continuation is masked in every copy with weight 1: the estimate is exactly its log-prob."""
    prefix, target = [1, 20, 21, 22], [23]
    estimate = mc_log_likelihood(lm.model, prefix, target, 8, 4, np.random.default_rng(0))
    plain = log_softmax(llada_jax.logits(lm.model, np.array([prefix + [MASK]]))[0, -1])[target[0]]
    assert estimate == pytest.approx(plain, abs=1e-5)


def test_two_token_likelihood_weights_each_mask_ratio(lm):
    """Two tokens, copies in pairs: one with both masked (weight 1), one with one of them masked (weight 2).
    Whatever position the draws mask, the estimate lies between the plain bounds."""
    prefix, target = [1, 30, 31], [32, 33]
    canvas = lambda *tokens: np.array([prefix + list(tokens)])  # noqa: E731
    both = log_softmax(llada_jax.logits(lm.model, canvas(MASK, MASK))[0, -2:])
    first = log_softmax(llada_jax.logits(lm.model, canvas(MASK, 33))[0, -2])[32]
    second = log_softmax(llada_jax.logits(lm.model, canvas(32, MASK))[0, -1])[33]
    joint = both[0, 32] + both[1, 33]
    estimate = mc_log_likelihood(lm.model, prefix, target, 64, 2, np.random.default_rng(3))
    low, high = sorted((first, second))
    assert (joint + 2 * low) / 2 - 1e-5 <= estimate <= (joint + 2 * high) / 2 + 1e-5


def test_generate_until_answers_as_generate_alone(lm):
    """Batched answers equal each prompt alone, cut at EOS / EoT and then at the request's stop strings."""
    tokenizer = lm.model.tokenizer
    examples = held_out(2)[:5]
    stops = [{"until": ["<|eot_id|>"]}, {"until": ["5"]}, {"until": "7"}, {}, {"until": ["9 9", "1"]}]
    requests = [SimpleNamespace(args=(tokenizer.chat_prompt(e.prompt), {**stop, "max_gen_toks": 30}))
                for e, stop in zip(examples, stops)]
    answers = lm.generate_until(requests)
    for example, stop, answer in zip(examples, stops, answers):
        ids = np.array(tokenizer.encode(tokenizer.chat_prompt(example.prompt)))
        result = llada_jax.generate(lm.model, ids, gen_length=32, block_length=8, steps=32, policy="dual-cache",
                                    threshold=0.9)
        want = answer_text(tokenizer, result.output_ids, lm.model.config)
        for text in [stop.get("until", [])] if isinstance(stop.get("until"), str) else stop.get("until", []):
            want = want.split(text)[0]
        assert answer == want


def test_bad_model_arguments_are_one_line_errors():
    with pytest.raises(LladaError, match="unknown llada-jax model arguments: colour"):
        LladaLM(colour="blue")
    with pytest.raises(LladaError, match="multiple of mc_batch_size"):
        LladaLM(mc_num=10, mc_batch_size=4)
    with pytest.raises(LladaError, match="batch_size must be an integer, got 'many'"):
        LladaLM(batch_size="many")
    with pytest.raises(LladaError, match="mc_num must be >= 32"):
        LladaLM(mc_num=0)
    with pytest.raises(LladaError, match="rolling"):
        LladaLM().loglikelihood_rolling([])
    with pytest.raises(LladaError, match="needs 2 devices; this host has 1"):
        LladaLM(data_devices="2")
    with pytest.raises(LladaError, match="model_devices must be >= 1"):
        LladaLM(model_devices="0")


def test_bad_model_arguments_that_once_ran_are_refused():
    """A non-finite cfg_scale gave NaN likelihoods (inf) or no guidance (nan); an empty pretrained loaded the
    embedded model."""
    for value in ("inf", "nan", "1e308"):
        with pytest.raises(LladaError, match=f"model argument cfg_scale must be (finite|<= 100.0), got '{value}'"):
            LladaLM(cfg_scale=value)
    with pytest.raises(LladaError, match="pretrained must name a model directory, got an empty string"):
        LladaLM(pretrained="")


@pytest.mark.parametrize("method, args, words", [
    ("loglikelihood", ("2+3=", "<|mdm_mask|>"), "context and continuation holds the mask token id 5"),
    ("loglikelihood", ("<|mdm_mask|>2+3=", "5"), "context and continuation holds the mask token id 5"),
    ("loglikelihood", (None, "5"), "context must be text, got NoneType"),
    ("loglikelihood", ("2+3=", 5), "continuation must be text, got int"),
    ("loglikelihood", ("2+3=",), "must carry 2 arguments"),
    ("generate_until", ("2+3=", {"max_gen_toks": "abc"}), "max_gen_toks must be an integer, got 'abc'"),
    ("generate_until", ("2+3=", {"max_gen_toks": -5}), "max_gen_toks must be >= 1, got -5"),
    ("generate_until", ("2+3=", {"do_sample": True, "temperature": "x"}), "temperature must be a number, got 'x'"),
    ("generate_until", ("2+3=", {"until": [5]}), r"stop strings \(until\) must be text, got \[5\]"),
    ("generate_until", ("2+3=", "stop"), "generation arguments must be a dict, got str"),
    ("generate_until", (None, {}), "context must be text, got NoneType"),
])
def test_hostile_requests_are_one_line_errors(lm, method, args, words):
    with pytest.raises(LladaError, match=words) as caught:
        getattr(lm, method)([SimpleNamespace(args=args)])
    assert "\n" not in str(caught.value)


def test_a_context_too_long_keeps_its_last_tokens_for_the_likelihood(lm):
    """As lm-eval does for its own models (and as generate_until does): not an error that ends the whole run."""
    tokenizer, room = lm.model.tokenizer, lm.model.config.max_sequence_length
    context, continuation = "1 2 3 " * 100, "4"
    prefix, target = lm._scored_pair(context, continuation)
    whole_prefix, whole_target = lm.encode_pair(context, continuation)
    assert target == whole_target and prefix == whole_prefix[-(room - len(target)):]
    assert len(prefix) + len(target) == room and tokenizer.decode(prefix).endswith("1 2 3")
    assert np.isfinite(lm.loglikelihood([SimpleNamespace(args=(context, continuation))])[0][0])


def test_lm_eval_runs_the_local_tasks_end_to_end(tmp_path):
    """`python -m eval.lm_harness` is lm-eval's command line: both local tasks, results written as lm-eval
    writes them."""
    command = [sys.executable, "-m", "eval.lm_harness", "--model", "llada-jax", "--model_args",
               "policy=dual-cache@0.9,block_length=8,mc_num=8,mc_batch_size=8,check_greedy=false",
               "--tasks", "llada_tasks,llada_choice", "--apply_chat_template", "--limit", "6", "--batch_size", "4",
               "--output_path", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    written = list(tmp_path.rglob("results_*.json"))
    assert len(written) == 1, run.stdout
    results = json.loads(written[0].read_text())["results"]
    assert results["llada_tasks"]["exact_match,none"] >= 5 / 6
    assert results["llada_choice"]["acc,none"] >= 4 / 6


def test_the_harness_command_line_refuses_bad_arguments_in_one_line():
    run = subprocess.run([sys.executable, "-m", "eval.lm_harness", "--model", "llada-jax", "--model_args",
                          "colour=blue", "--tasks", "llada_tasks", "--limit", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == "llada-lm-eval: error: unknown llada-jax model arguments: colour"
