"""Training smoke test: a few steps, the masked-diffusion corruption, and exact resumption after a kill."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import llada_jax
from llada_jax.training import train as training
from llada_jax.training.train import TrainSettings, corrupt, train

SETTINGS = TrainSettings(steps=4, batch=4, seq_len=96, learning_rate=1e-3, warmup=1, checkpoint_every=2)
CONFIG = dataclasses.replace(training.embedded_model_config(d_model=32, n_layers=1), max_sequence_length=128)


@pytest.mark.parametrize("block_aware", [0.0, 1.0])
def test_corruption_never_masks_the_prompt_and_weights_are_inverse_t(block_aware):
    settings = dataclasses.replace(SETTINGS, block_aware=block_aware, batch=64)
    tokens = jnp.full((64, 96), 7, jnp.int32)
    prompt_len = jnp.asarray(np.random.default_rng(0).integers(5, 60, 64), jnp.int32)
    noisy, weight = corrupt(jax.random.PRNGKey(1), tokens, prompt_len, settings, mask_id=99)
    noisy, weight, prompt_len = np.asarray(noisy), np.asarray(weight), np.asarray(prompt_len)
    pos = np.arange(96)[None]
    response = (pos >= prompt_len[:, None]) & (pos < prompt_len[:, None] + 32)
    masked = noisy == 99
    assert not (masked & ~response).any()
    assert ((weight > 0) == masked).all()
    assert (weight[masked] >= 1.0).all()
    assert masked.sum() > 0 and (~masked & response).sum() > 0
    if block_aware:
        for row in range(64):  # once a block is fully masked, every later block is too
            blocks = masked[row, prompt_len[row]: prompt_len[row] + 32].reshape(4, 8)
            full = blocks.all(axis=1)
            first_full = np.argmax(full) if full.any() else 4
            assert full[first_full:].all() and not blocks[: max(first_full - 1, 0)].any()


@pytest.mark.slow
def test_training_resumes_exactly_after_a_kill(tmp_path, monkeypatch):
    straight = train(tmp_path / "straight", SETTINGS, CONFIG, progress=False)
    real_step = training.train_step
    calls = {"n": 0}

    def dying_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt  # killed after the step-2 checkpoint
        return real_step(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "resumed", SETTINGS, CONFIG, progress=False)
    monkeypatch.setattr(training, "train_step", real_step)
    resumed = train(tmp_path / "resumed", SETTINGS, CONFIG, progress=False)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7)
    model = llada_jax.load(resumed)
    assert model.tokenizer.decode(model.tokenizer.encode("sort 1 2")) == "sort 1 2"
    assert model.config.mask_token_id == model.tokenizer.token_id("<|mdm_mask|>")


def test_resuming_with_other_settings_is_refused(tmp_path):
    train(tmp_path / "run", dataclasses.replace(SETTINGS, steps=1), CONFIG, progress=False)
    with pytest.raises(llada_jax.LladaError, match="other settings"):
        train(tmp_path / "run", SETTINGS, CONFIG, progress=False)


@pytest.mark.parametrize("damage, words", [
    (lambda run: (run / "run.json").write_text("{bad"), "run.json is not valid JSON"),
    (lambda run: (run / "run.json").write_text("[]"), "run.json holds no run's settings and config"),
    (lambda run: (run / "run.json").write_text('{"settings": {}}'), "run.json holds no run's settings and config"),
    (lambda run: [path.unlink() for path in (run / "checkpoints" / "1").rglob("*") if path.is_file()],
     "checkpoint 1 of the run cannot be restored"),
])
def test_a_damaged_run_is_refused_in_one_line_by_resuming_and_exporting(tmp_path, damage, words):
    run = tmp_path / "run"
    settings = dataclasses.replace(SETTINGS, steps=1, checkpoint_every=1)
    train(run, settings, CONFIG, progress=False)
    damage(run)
    for attempt in (lambda: train(run, settings, CONFIG, progress=False),
                    lambda: training.export_latest(run, tmp_path / "exported")):
        with pytest.raises(llada_jax.LladaError, match=words) as caught:
            attempt()
        assert "\n" not in str(caught.value)


def test_stopping_early_then_continuing_equals_one_run(tmp_path):
    straight = train(tmp_path / "straight", SETTINGS, CONFIG, progress=False)
    train(tmp_path / "staged", SETTINGS, CONFIG, progress=False, stop_at=3)
    continued = train(tmp_path / "staged", SETTINGS, CONFIG, progress=False)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(continued / "model.safetensors"))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7)


def test_a_diverging_run_stops_before_it_saves_or_exports_non_finite_weights(tmp_path):
    run = tmp_path / "run"
    diverged = r"training diverged by step 2 .* nothing was saved; .* smaller --lr"
    with pytest.raises(llada_jax.LladaError, match=diverged):
        train(run, dataclasses.replace(SETTINGS, learning_rate=1e20), CONFIG, progress=False)
    assert not (run / "model").exists() and not list((run / "checkpoints").iterdir())


@pytest.mark.parametrize("change, words", [
    (dict(learning_rate=float("inf")), "a finite lr > 0"), (dict(seed=-1), r"seed must be in \[0, 2\^32\)"),
    (dict(seed=2**64), r"seed must be in \[0, 2\^32\)"),
])
def test_bad_settings_are_refused_before_a_run_starts(tmp_path, change, words):
    with pytest.raises(llada_jax.LladaError, match=words):
        train(tmp_path / "run", dataclasses.replace(SETTINGS, **change), CONFIG, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_that_saved_nothing_takes_new_settings_and_one_past_stop_at_is_refused(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(llada_jax.LladaError, match="diverged"):
        train(run, dataclasses.replace(SETTINGS, learning_rate=1e20), CONFIG, progress=False)
    train(run, SETTINGS, CONFIG, progress=False, stop_at=3)  # the failed run left nothing to keep
    with pytest.raises(llada_jax.LladaError, match="already at step 3, past --stop-at 2: a run does not go back"):
        train(run, SETTINGS, CONFIG, progress=False, stop_at=2)


def test_force_without_export_to_is_refused(capsys, tmp_path):
    from llada_jax.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), "--force"]) == 1
    assert capsys.readouterr().err == "llada: error: --force replaces an earlier export: it goes with --export-to\n"
    assert not (tmp_path / "run").exists()


def test_an_allocation_past_the_hosts_memory_is_one_line(capsys, tmp_path, monkeypatch):
    import llada_jax.cli.train
    from llada_jax.cli import main

    def too_big(*_args, **_kwargs):
        raise MemoryError("Unable to allocate 34.9 TiB for an array with shape (100000000000, 96)")

    monkeypatch.setattr(llada_jax.cli.train, "train", too_big)
    assert main(["train", "--out", str(tmp_path / "run"), "--batch", "100000000000"]) == 1
    assert capsys.readouterr().err == ("llada: error: out of host memory: Unable to allocate 34.9 TiB for an array "
                                       "with shape (100000000000, 96)\n")
