"""LLaDA2 beyond the reference samplers: multi-block speculation under the block-causal mask, layer-by-layer
residency for models whose step holds too many expert loops, and block diffusion's likelihood bound (dllm's BD3LM
eval), each against a plain computation."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from eval.mc_likelihood import block_greedy_answer, mask_counts, masked_copies, mc_log_likelihood, true_log_probs
from llada_jax.model.config import read_config
from llada_jax.weights import loading
from llada_jax.weights.loading import layered_execution
from tests import llada2_reference as ref
from tests.test_llada2 import CONFIG, PROMPTS, float64_weights, write_tiny

MASK = CONFIG.mask_token_id


class Tiny(NamedTuple):
    checkpoint: Path
    model: llada_jax.Model
    weights: dict  # float64, for the oracle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    """tests/test_llada2.py's tiny model."""
    checkpoint = write_tiny(tmp_path_factory.mktemp("llada2"))
    return Tiny(checkpoint, llada_jax.load(checkpoint), float64_weights(checkpoint))


@pytest.mark.slow
@settings(max_examples=25)
@given(prompt=PROMPTS, block=st.sampled_from([2, 4, 8]), gen=st.integers(1, 16), lookahead=st.integers(1, 3),
       draft=st.sampled_from([0.05, 0.3, 0.9]), editing=st.sampled_from([None, 0.3]),
       base=st.sampled_from(["dual-cache", "vanilla"]))
def test_speculative_drafts_see_what_the_block_causal_mask_lets_them_see(tiny, prompt, block, gen, lookahead, draft,
                                                                         editing, base):
    """Each step's commits, the current block's and the drafts of the following blocks alike, are the block-causal
    model's prediction over the canvas as it stood before the step (`llada_jax.logits` with the block length):
    a draft sees its own block and the earlier ones, and no block sees a later one's drafts."""
    canvases = []
    options = dict(gen_length=gen, block_length=block, steps=block, threshold=0.3, editing_threshold=editing,
                   policy=f"{base}+speculative:{lookahead}:{draft}")
    result = llada_jax.generate(tiny.model, np.array(prompt), on_step=lambda canvas, _: canvases.append(
        canvas.tokens[0, : canvas.length].copy()), **options)
    start = np.full(len(canvases[0]), CONFIG.mask_token_id)
    start[: len(prompt)] = prompt
    before = [start] + canvases[:-1]
    logits = llada_jax.logits(tiny.model, np.stack(before), block_length=block).astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for step, record in enumerate(result.trace):
        positions = list(record.positions)
        assert list(record.tokens) == probs[step, positions].argmax(-1).tolist()
        assert list(record.confidence) == pytest.approx(probs[step, positions].max(-1), abs=1e-4)
        assert all(positions[i] // block > record.block for i in range(len(positions) - record.drafts, len(positions)))
    exact = llada_jax.generate(tiny.model, np.array(prompt), **{**options, "policy": f"{base}+speculative:0"})
    plain = llada_jax.generate(tiny.model, np.array(prompt), **{**options, "policy": base})
    assert exact.output_ids.tolist() == plain.output_ids.tolist() and exact.nfe == plain.nfe


@pytest.fixture(scope="module")
def layered_model(tiny):
    """The tiny model loaded as if its expert loops were too many for one step program."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "WHOLE_STEP_EXPERT_LOOPS", 0)
        return llada_jax.load(tiny.checkpoint)


def test_only_models_with_too_many_expert_loops_run_layer_by_layer(tiny, layered_model):
    data = Path(__file__).parents[1] / "eval" / "data"
    assert layered_execution(read_config(data / "llada2-mini"))  # 19 sparse layers x 256 experts
    assert not layered_execution(read_config(data / "llada-moe-7b-a1b-instruct"))  # 16 x 64
    assert tiny.model.params is not None and not tiny.model.layered
    assert layered_model.layered and layered_model.params is None and layered_model.staged is not None


def test_a_layered_model_puts_its_stages_on_the_device_once(layered_model):
    """Held from the load on: no generation copies a stage."""
    assert layered_model.device_stages is not None
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8]):
        stats = llada_jax.generate(layered_model, np.array(prompt), gen_length=6, block_length=4, steps=4).stats
        assert stats["bytes_staged"] == 0 and stats["pinned_stages"] == len(layered_model.staged.stages)


@pytest.mark.slow
@settings(max_examples=15)
@given(prompt=PROMPTS, block=st.sampled_from([4, 8]), gen=st.integers(1, 12), editing=st.sampled_from([None, 0.3]),
       policy=st.sampled_from(["dual-cache", "vanilla"]))
def test_layer_by_layer_gives_the_whole_step_tokens(tiny, layered_model, prompt, block, gen, editing, policy):
    """One compiled piece per layer shape, every stage resident (nothing streamed): the whole step's tokens and
    confidences."""
    options = dict(gen_length=gen, block_length=block, steps=block, threshold=0.3, editing_threshold=editing,
                   policy=policy)
    layered = llada_jax.generate(layered_model, np.array(prompt), **options)
    whole = llada_jax.generate(tiny.model, np.array(prompt), **options)
    assert layered.output_ids.tolist() == whole.output_ids.tolist()
    confidences = [[c for record in result.trace for c in record.confidence] for result in (layered, whole)]
    assert confidences[0] == pytest.approx(confidences[1], abs=1e-5)


@pytest.mark.parametrize("length, block_length", [(9, 4), (13, 8), (6, 8)])
def test_a_noised_sequence_reads_the_clean_earlier_blocks_as_the_bd3lm_oracle(tiny, length, block_length):
    rng = np.random.default_rng(length)
    clean = rng.integers(0, 90, (2, length))
    noised = np.where(rng.random(clean.shape) < 0.5, MASK, clean)
    ours = llada_jax.logits(tiny.model, noised, block_length=block_length, context_ids=clean)
    expected = ref.forward_noised(tiny.weights, CONFIG, noised, clean, block_length)
    np.testing.assert_allclose(ours, expected, atol=2e-4, rtol=2e-4)


def test_context_ids_are_checked(tiny):
    with pytest.raises(llada_jax.LladaError, match="give block_length too"):
        llada_jax.logits(tiny.model, np.zeros((1, 4), int), context_ids=np.zeros((1, 4), int))
    with pytest.raises(llada_jax.LladaError, match="the shape of ids"):
        llada_jax.logits(tiny.model, np.zeros((1, 4), int), block_length=4, context_ids=np.zeros((1, 5), int))


@pytest.mark.parametrize("block", [2, 4])
def test_block_likelihood_is_the_bd3lm_monte_carlo_bound(tiny, block):
    """Copies masked as LLaDA's estimate draws them; each read against the clean sequence's earlier blocks; the
    masked tokens' log-probabilities weighted by 1 / (fraction masked), averaged (dllm's BD3LM loglikelihood)."""
    prefix, target = [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]
    ours = mc_log_likelihood(tiny.model, prefix, target, 8, 4, np.random.default_rng(3), block_length=block)
    rng, sequence, estimates = np.random.default_rng(3), np.array(prefix + target), []
    for _ in range(2):
        counts = mask_counts(rng, len(target), 4)
        copies = masked_copies(rng, sequence, len(prefix), counts, MASK)
        logits = ref.forward_noised(tiny.weights, CONFIG, copies, np.tile(sequence, (4, 1)), block)
        log_probs = true_log_probs(logits, sequence)
        estimates.append(np.mean((log_probs * (copies == MASK)).sum(1) / (counts / len(target))))
    assert ours == pytest.approx(np.mean(estimates), rel=1e-4)


def bd3lm_greedy(weights, prefix: list[int], target: list[int], block: int) -> list[int]:
    """dllm's BD3LM greedy check, restated: one token per step over the whole continuation, the most confident."""
    clean = np.array([prefix + target])
    canvas = clean.copy()
    canvas[0, len(prefix):] = MASK
    for _ in target:
        logits = ref.forward_noised(weights, CONFIG, canvas, clean, block)[0]
        x0 = logits.argmax(-1)
        confidence = np.exp(true_log_probs(logits[None], x0)[0])
        best = int(np.argmax(np.where(canvas[0] == MASK, confidence, -np.inf)))
        canvas[0, best] = x0[best]
    return canvas[0, len(prefix):].tolist()


@settings(max_examples=15, deadline=None)
@given(prefix=st.lists(st.integers(0, 89), min_size=1, max_size=7), target=st.lists(st.integers(0, 89), min_size=1,
       max_size=9), block=st.sampled_from([2, 4, 8]))
def test_the_block_greedy_check_unmasks_as_the_bd3lm_check(tiny, prefix, target, block):
    assert block_greedy_answer(tiny.model, prefix, target, block) == bd3lm_greedy(tiny.weights, prefix, target, block)
