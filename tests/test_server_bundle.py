"""`llada serve --bundle`: what the bundle cannot run (a sampled readout, CFG, a window wider than it was compiled
for) is the client's error, a 400 before the request is queued, not a 500 from the generation; what it can run is
answered as `llada generate --bundle` answers it."""

from __future__ import annotations

import pytest

from llada_jax.cli import build_parser
from llada_jax.cli.serve import served_model
from llada_jax.server.app import create_app
from llada_jax.system.locations import EMBEDDED_DIR
from lowering.bundle import compile_bundle
from tests.test_server import running
from tests.test_server_hostile import post

pytestmark = pytest.mark.slow  # an IREE compile


@pytest.fixture(scope="module")
def bundle_server(tmp_path_factory):
    """The embedded model's bundle, windows of at most 8 positions, served as `llada serve --bundle` serves it."""
    bundle = compile_bundle(EMBEDDED_DIR, "host", tmp_path_factory.mktemp("served") / "narrow", max_len=64, window=8)
    served, engine = served_model(build_parser().parse_args(["serve", "--bundle", str(bundle), "--max-batch", "1"]))
    with running(create_app(served, engine, None)) as url:
        yield url.removeprefix("http://").removesuffix("/v1"), served.name


@pytest.mark.parametrize("fields, words", [
    ({"temperature": 0.7}, "IREE bundles read out the argmax only"),
    ({"temperature": 0.7, "n": 3}, "IREE bundles read out the argmax only"),
    ({"cfg_scale": 1.0}, "IREE bundles read out the argmax only"),
    ({"policy": "dual-cache", "block_length": 16}, "the decoder needs a window of 16 positions"),
])
def test_what_the_bundle_cannot_run_is_a_400(bundle_server, fields, words):
    address, name = bundle_server
    body = {"model": name, "prompt": "sort 3 1 2", "max_tokens": 16, **fields}
    status, error = post((address, None), "/v1/completions", body)
    assert status == 400, error
    assert error["error"]["type"] == "invalid_request_error" and words in error["error"]["message"]
    status, answer = post((address, None), "/v1/completions",
                          {"model": name, "prompt": "sort 3 1 2", "max_tokens": 16, "policy": "dual-cache",
                           "block_length": 8})
    assert status == 200 and answer["choices"][0]["text"]
