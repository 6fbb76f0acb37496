"""The compiled block-diffusion loop in a bundle (LLaDA2, int4, its experts stacked on our routed kernels): for
each decoder (2.0, 2.1's editing, speculation's drafts), resident or streamed under a budget, `llada compile` bakes
it with `run.sh`, and both give the bundle's host loop's tokens and passes (and XLA's tokens, W4A16; speculation,
which the bundle's steps cannot mask, XLA's compiled loop's). A float checkpoint's refusal: `tests/test_llada2.py`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.bundle_runner import bundle_runner
from llada_jax.cli import main
from tests.conftest import bundle_weight_bytes, cli_flags
from tests.test_decode_loop_bundle import host_iree_run_module, run_script
from tests.test_llada2 import CONFIG
from tests.test_llada2 import write_tiny as write_llada2
from tests.test_moe import int4_llada2

MAX_LEN = 32
LLADA20 = dict(gen_length=12, block_length=8, steps=8, threshold=0.95)
LLADA21 = dict(gen_length=12, block_length=8, steps=8, threshold=0.7, editing_threshold=0.5)
SETTINGS = {  # activations, the decoder's flags, whether the program streams its weights under a budget
    "LLaDA2.0": ("int8", LLADA20, False),
    "LLaDA2.1": ("float", LLADA21, False),
    "LLaDA2.1+speculative": ("float", dict(LLADA21, lookahead=1, draft_threshold=0.3), False),
    "LLaDA2.0 streamed": ("float", LLADA20, True),
    "LLaDA2.1 streamed": ("int8", LLADA21, True),
}
PROMPTS = st.lists(st.integers(0, CONFIG.embedding_size - 1).filter(lambda t: t != CONFIG.mask_token_id),
                   min_size=1, max_size=MAX_LEN - 12).map(np.array)  # canvases of 16 and 32 positions


def _decoding(flags: dict) -> dict:
    """`llada_jax.generate`'s keywords for a setting's flags (speculation's as a policy)."""
    options = {name: value for name, value in flags.items() if name not in ("lookahead", "draft_threshold")}
    if "lookahead" in flags:
        options["policy"] = f"dual-cache+speculative:{flags['lookahead']}:{flags['draft_threshold']}"
    return options


@pytest.fixture(scope="module", params=list(SETTINGS))
def baked(request, tmp_path_factory):
    """(decoder, bundle, its generate function, the XLA model): the bundle `llada compile` writes for the
    decoder's flags."""
    decoder = request.param
    config, checkpoint = int4_llada2(tmp_path_factory.mktemp("llada2"))  # skips without a C compiler for our kernels
    activations, options, streamed = SETTINGS[decoder]
    bundle = checkpoint.parent / "bundle"
    budget = ["--device-memory-budget", str(bundle_weight_bytes(checkpoint) - 1)] if streamed else []
    assert main(["compile", "--model", str(checkpoint), "--target", "host", "--out", str(bundle), "--max-len",
                 str(MAX_LEN), "--activations", activations, *budget, *cli_flags(options)]) == 0
    assert bool(json.loads((bundle / "manifest.json").read_text())["streamed"]) == streamed
    return decoder, bundle, bundle_runner(bundle)[2], llada_jax.load(checkpoint, activations=activations)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=PROMPTS)
def test_the_bundles_block_loop_is_its_host_loop(baked, prompt):
    decoder, _, generate_bundled, model = baked
    activations, options, _ = SETTINGS[decoder]
    options = _decoding(options)
    compiled = generate_bundled(prompt, loop="compiled", **options)
    assert compiled.stats["loop"] == "compiled"
    reference = (generate_bundled(prompt, loop="host", **options) if "lookahead" not in SETTINGS[decoder][1]
                 else llada_jax.generate(model, prompt, loop="compiled", **options))  # drafts: no bundle host loop
    assert (compiled.output_ids.tolist(), compiled.nfe) == (reference.output_ids.tolist(), reference.nfe)
    assert [record.positions for record in compiled.trace] == [record.positions for record in reference.trace]
    if activations == "float":  # W4A8 rounds activations on IREE and XLA apart (docs/kernels.md)
        assert compiled.output_ids.tolist() == llada_jax.generate(model, prompt, **options).output_ids.tolist()


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


@pytest.mark.slow
def test_run_sh_gives_the_bundles_tokens(baked):
    decoder, bundle, generate_bundled, _ = baked
    manifest = json.loads((bundle / "manifest.json").read_text(), parse_constant=_not_json)  # strict JSON
    assert [entry["kind"] for entry in manifest["loops"]] == ["block_loop"] * 2  # canvases of 16 and 32
    for prompt in (np.arange(1, 6), np.arange(7, 22)):
        bundled = generate_bundled(prompt, loop="compiled", **_decoding(SETTINGS[decoder][1]))
        proc = run_script(bundle, ",".join(map(str, prompt)), str(host_iree_run_module()))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == ",".join(map(str, bundled.output_ids.tolist()))
        assert f"[{bundled.nfe} forward passes]" in proc.stderr


def test_compile_refuses_a_loop_setting_it_cannot_bake_in_one_line(tmp_path, capsys):
    """Before any export: LLaDA2's uncached decoder, and a block flag on a model that is not block diffusion."""
    checkpoint = write_llada2(tmp_path)
    common = ["compile", "--target", "host", "--max-len", "32", "--gen-length", "8"]
    for model, flags, said in ((checkpoint, ["--policy", "vanilla"], "vanilla decoder runs only on the host loop"),
                               (None, ["--editing-threshold", "0.5"], "--editing-threshold is LLaDA2's")):
        model_flags = ["--model", str(model)] if model else []
        assert main([*common, *model_flags, "--out", str(tmp_path / "bundle"), *flags]) == 1
        error = capsys.readouterr().err.strip()
        assert said in error and len(error.splitlines()) == 1
        assert not (tmp_path / "bundle").exists()
