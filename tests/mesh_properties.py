"""Properties of a model sharded over a mesh, on 4 devices. JAX fixes its device count when it starts, so
`tests/test_mesh.py` runs this file in a child pytest with XLA_FLAGS=--xla_force_host_platform_device_count=4
(the program JAX runs on 4 accelerators). Not collected by the main run (its name has no test_ prefix)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from llada_jax import api
from llada_jax.model.mesh import MeshSpec
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.system.locations import EMBEDDED_DIR
from llada_jax.training.tasks import held_out
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint

MESHES = ("data=4", "data=2,model=2", "model=4", "data=all")
POLICIES = ("vanilla", "prefix-cache", "dual-cache", "dual-cache+speculative@0.9", "prefix-cache@0.7",
            "dual-cache+revision@0.9")

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices: run by tests/test_mesh.py")


@pytest.fixture(scope="module")
def one_device():
    return api.load(EMBEDDED_DIR)


@pytest.fixture(scope="module")
def meshed():
    return {spec: api.load(EMBEDDED_DIR, mesh=MeshSpec.parse(spec).build()) for spec in MESHES}


@pytest.fixture(scope="module")
def prompts(one_device):
    tokenizer = one_device.tokenizer
    return [np.array(tokenizer.encode(tokenizer.chat_prompt(example.prompt))) for example in held_out(4)]


def decoding(policy: str) -> dict:
    name, _, threshold = policy.partition("@")
    return {"gen_length": 32, "block_length": 8, "steps": 32, "policy": name,
            "threshold": float(threshold) if threshold else None}


@settings(max_examples=8)
@given(policy=st.sampled_from(POLICIES), spec=st.sampled_from(MESHES), picks=st.lists(st.integers(0, 15), min_size=1,
                                                                                     max_size=7))
def test_a_batch_on_a_mesh_decodes_as_on_one_device(one_device, meshed, prompts, policy, spec, picks):
    """Any batch (rows dividing the data axis or not), any policy: every row's tokens and forward passes."""
    batch = [prompts[pick] for pick in picks]
    alone = api.generate(one_device, batch, **decoding(policy))
    sharded = api.generate(meshed[spec], batch, **decoding(policy))
    for row, (want, got) in enumerate(zip(alone, sharded)):
        assert got.output_ids.tolist() == want.output_ids.tolist(), (policy, spec, row)
        assert got.nfe == want.nfe


def test_rows_and_weights_are_split_where_the_mesh_says(meshed):
    model = meshed["data=2,model=2"]
    block = model.params["blocks"][0]
    assert block["q_proj"].sharding.spec == P("model", None) and block["attn_out"].sharding.spec == P(None, "model")
    assert block["ff_out"].sharding.spec == P(None, "model") and block["attn_norm"].sharding.spec == P()
    assert model.params["lm_head"].sharding.spec == P("model", None)
    from llada_jax.backends.select import select_backend
    from llada_jax.model.readout import ReadoutSpec, TokenBiases
    from policies.backend import BackendRequest

    backend = select_backend(model, BackendRequest(readout_spec=ReadoutSpec(kind="argmax"), rows=4, slots=128,
                                                   biases=TokenBiases.build(model.config.embedding_size)))
    out = backend.full(np.full((4, 128), 1, np.int32), np.ones((4, 128), bool))
    rows_per_device = {shard.data.shape[1] for shard in out.keys.addressable_shards}
    heads_per_device = {shard.data.shape[3] for shard in out.keys.addressable_shards}
    assert rows_per_device == {2} and heads_per_device == {model.config.n_kv_heads // 2}


def test_logits_on_a_model_axis_equal_one_device_within_rounding(one_device, meshed, prompts):
    ids = np.stack([prompts[0]] * 4)
    want = api.logits(one_device, ids)
    for spec in MESHES:
        got = api.logits(meshed[spec], ids)
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4, err_msg=spec)


def test_a_quantized_model_on_a_mesh_decodes_as_on_one_device(tmp_path, prompts):
    quantized = quantize_checkpoint(EMBEDDED_DIR, tmp_path / "int4", QuantScheme(4, 32))
    alone = api.generate(api.load(quantized), prompts[:4], **decoding("dual-cache"))
    sharded = api.generate(api.load(quantized, mesh=MeshSpec.parse("data=2,model=2").build()), prompts[:4],
                           **decoding("dual-cache"))
    assert [r.output_ids.tolist() for r in sharded] == [r.output_ids.tolist() for r in alone]


@pytest.mark.parametrize(("spec", "message"), [
    ("data=8", "needs 8 devices; this host has 4"),
    ("data=2,model=3", "needs 6 devices"),
])
def test_a_mesh_larger_than_the_host_is_refused(spec, message):
    with pytest.raises(LladaError, match=message):
        MeshSpec.parse(spec).build()


def test_a_model_axis_that_does_not_divide_the_heads_is_refused(tmp_path):
    from tests.conftest import TINY, write_checkpoint  # 4 heads, 2 K/V heads

    with pytest.raises(LladaError, match="must divide the model's 4 attention heads and 2 K/V heads"):
        api.load(write_checkpoint(tmp_path / "tiny", TINY), mesh=MeshSpec.parse("model=4").build())
