"""Non-finite numbers never become an answer: a step whose readout holds NaN/Inf stops generation with a
one-line error naming the step and position, and --check-weights names the bad tensor at load."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import llada_jax
from llada_jax.cli import main
from llada_jax.system.errors import LladaError
from tests.conftest import write_checkpoint

PROMPT = np.array([5, 6, 7, 8])
OPTIONS = dict(gen_length=16, block_length=8, steps=8)
BAD_TENSOR = "model.transformer.blocks.1.ff_out.weight"


def poisoned(tmp_path, value: float, index=(3, 7)):
    model_dir = write_checkpoint(tmp_path / "model")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors[BAD_TENSOR][index] = value
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("policy, loop, position", [
    ("vanilla", "host", 4), ("vanilla", "compiled", 4),  # vanilla reads out the block only: it starts at 4
    ("dual-cache+speculative", "host", 0), ("dual-cache+speculative", "compiled", 0),
    ("dual-cache+revision", "auto", 0)])
def test_nonfinite_weights_stop_generation_at_the_first_step(tmp_path, value, policy, loop, position):
    """The error names the first position the step read out whose score is not finite."""
    model = llada_jax.load(poisoned(tmp_path, value))
    message = rf"^step 1 produced a non-finite score \(NaN/Inf\) at canvas position {position}:"
    with pytest.raises(LladaError, match=message):
        llada_jax.generate(model, PROMPT, policy=policy, loop=loop, **OPTIONS)


def test_nonfinite_logits_readout_is_refused_too(tmp_path):
    model = llada_jax.load(poisoned(tmp_path, np.nan))
    with pytest.raises(LladaError, match="non-finite score"):
        llada_jax.generate(model, PROMPT, temperature=0.5, **OPTIONS)  # logits come back to the host


def test_finite_weights_pass_the_check(tiny_dir):
    result = llada_jax.generate(llada_jax.load(tiny_dir, check_weights=True), PROMPT, **OPTIONS)
    assert result.nfe == 8


def test_cli_reports_nan_weights_in_one_line(tmp_path, capsys):
    model_dir = poisoned(tmp_path, np.nan)
    args = ["generate", "--model", str(model_dir), "--prompt-ids", "5,6,7", "--gen-length", "16", "--steps", "16"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("llada: error: step 1 produced a non-finite score") and err.count("\n") == 1
    assert main([*args, "--check-weights"]) == 1
    err = capsys.readouterr().err
    assert err == (f"llada: error: {model_dir}: tensor {BAD_TENSOR} holds a non-finite value (nan) "
                   "at index [3, 7]\n")
