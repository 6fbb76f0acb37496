"""The compiled block-diffusion loop (`policies.block_loop`) is the host loop of `policies.block_diffusion`
pass for pass: the same tokens, forward passes, commits, drafts, edits and cache passes (confidences to
float32 rounding), for LLaDA2.0 and LLaDA2.1, with and without speculation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import llada_jax
from llada_jax.system.errors import LladaError
from tests.test_llada2 import PROMPTS, write_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tests/test_llada2.py's tiny model."""
    return llada_jax.load(write_tiny(tmp_path_factory.mktemp("llada2")))


def assert_same_run(host, compiled):
    """Everything the host loop reports, the compiled loop reports too (confidences to float32 rounding)."""
    assert compiled.stats.pop("loop") == "compiled"
    assert "loop" not in host.stats
    for result in (host, compiled):
        result.stats.pop("step_call_seconds", None)
    assert compiled.output_ids.tolist() == host.output_ids.tolist()
    assert (compiled.nfe, compiled.stats) == (host.nfe, host.stats)
    def without_confidence(trace):
        return [dataclasses.replace(record, confidence=()) for record in trace]

    assert without_confidence(compiled.trace) == without_confidence(host.trace)
    for ours, theirs in zip(compiled.trace, host.trace):
        assert ours.confidence == pytest.approx(theirs.confidence, rel=1e-5, abs=1e-6)


@pytest.mark.slow
@settings(max_examples=24, deadline=None)
@given(prompt=PROMPTS, block=st.sampled_from([2, 4]), gen=st.sampled_from([5, 8]), lookahead=st.sampled_from([0, 2]),
       editing=st.sampled_from([None, 0.2, 0.6]), threshold=st.sampled_from([None, 0.3, 0.7]),
       draft=st.sampled_from([0.05, 0.5]))
def test_the_compiled_loop_is_the_host_loop(model, prompt, block, gen, lookahead, editing, threshold, draft):
    policy = f"dual-cache+speculative:{lookahead}:{draft}" if lookahead else "dual-cache"
    options = dict(gen_length=gen, block_length=block, steps=block, threshold=threshold, editing_threshold=editing,
                   max_post_steps=2, policy=policy)
    host = llada_jax.generate(model, np.array(prompt), loop="host", **options)
    compiled = llada_jax.generate(model, np.array(prompt), loop="compiled", **options)
    assert_same_run(host, compiled)


def test_a_block_the_reference_never_ends_is_bounded_alike(model):
    """A 2.1 block whose state comes back (the reference would loop forever): both loops stop it at the same
    pass and count it."""
    options = dict(gen_length=10, block_length=4, steps=4, threshold=0.05, editing_threshold=0.9, max_post_steps=1,
                   num_to_transfer=3)
    host = llada_jax.generate(model, np.array([44, 44, 6]), loop="host", **options)
    assert host.stats["bounded_blocks"] == 1
    assert_same_run(host, llada_jax.generate(model, np.array([44, 44, 6]), loop="compiled", **options))


def test_auto_runs_the_compiled_loop_where_it_covers_the_setting(model):
    options = dict(gen_length=6, block_length=4, steps=4)
    assert llada_jax.generate(model, np.array([1, 2, 3]), **options).stats["loop"] == "compiled"
    for uncovered in (dict(policy="vanilla"), dict(temperature=0.5)):
        assert "loop" not in llada_jax.generate(model, np.array([1, 2, 3]), **options, **uncovered).stats
    steps = []
    live = llada_jax.generate(model, np.array([1, 2, 3]), on_step=lambda _, record: steps.append(record), **options)
    assert "loop" not in live.stats and len(steps) == live.nfe
    with pytest.raises(LladaError, match="block diffusion's cached decoders at temperature 0"):
        llada_jax.generate(model, np.array([1, 2, 3]), loop="compiled", policy="vanilla", **options)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_nonfinite_readout_is_the_host_loops_error(tmp_path, value):
    poisoned = write_tiny(tmp_path)
    tensors = load_file(str(poisoned / "model.safetensors"))
    tensors["model.layers.2.mlp.shared_experts.down_proj.weight"][3, 5] = value
    save_file(tensors, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    model = llada_jax.load(poisoned)
    messages = []
    for loop in ("host", "compiled"):
        with pytest.raises(LladaError, match=r"^step 1 produced a non-finite score") as error:
            llada_jax.generate(model, np.array([1, 2, 3, 4, 5]), loop=loop, gen_length=6, block_length=4, steps=4)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
