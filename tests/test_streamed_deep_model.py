"""A 60-layer model's streamed bundle (`lowering.stage_ring`) prints XLA's tokens through `run.sh`: a file of its
own, since its compile is minutes (test files are spread over the test workers whole)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import bundle_weight_bytes, cli_flags, write_checkpoint
from tests.test_streamed_bundles import DEEP, run_script, xla_ids


@pytest.mark.slow
def test_a_deep_model_streams_the_xla_tokens(tmp_path, capsys):
    """60 layers, each stage reading the next one while it computes: an earlier read-ahead, whose ring state ran
    across calls and loop passes, gave this model wrong tokens (docs/iree-limits.md). XLA's tokens are the
    reference here: a resident bundle of 60 layers is minutes more of compiling."""
    from llada_jax.cli import main

    model = write_checkpoint(tmp_path / "model", dataclasses.replace(DEEP, n_layers=60), std=0.3)
    setting = dict(gen_length=16, block_length=16, steps=16)
    assert main(["compile", "--model", str(model), "--target", "host", "--out", str(tmp_path / "streamed"),
                 "--max-len", "32", "--window", "32", "--device-memory-budget", str(bundle_weight_bytes(model) // 4),
                 *cli_flags(setting)]) == 0
    assert run_script(tmp_path / "streamed", "1,2,3,4,5") == xla_ids(capsys, model, "1,2,3,4,5", setting)
