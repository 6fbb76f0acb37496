"""HF layout in and out: bit-exact round trips, the real 8B index, and a one-line error per fault."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import llada_jax
from llada_jax.model.config import read_config
from llada_jax.model.params import hf_shapes, params_to_hf
from llada_jax.system.errors import LladaError
from llada_jax.weights.checkpoint import save_hf
from tests.conftest import LLADA_8B_DIR, TINY, read_all, write_checkpoint


def raw_tensors(model_dir):
    from safetensors import safe_open

    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


@pytest.mark.parametrize("stored, compute, shards", [("float32", "float32", None), ("bfloat16", "bfloat16", 20_000),
                                                     ("bfloat16", "float32", None)])
def test_hf_round_trip_is_bit_exact(tmp_path, stored, compute, shards):
    source = write_checkpoint(tmp_path / "src", stored_dtype=stored, shard_bytes=shards)
    model = llada_jax.load(source, dtype=compute)
    copy = save_hf(model.params, model.config, tmp_path / "copy", stored_dtype=stored, shard_bytes=shards)
    before, after = raw_tensors(source), raw_tensors(copy)
    assert list(before) == list(after)
    for name in before:
        assert before[name].dtype == after[name].dtype
        assert before[name].tobytes() == after[name].tobytes(), name
    assert llada_jax.load(copy).config == model.config


def test_sharded_checkpoint_has_an_index_naming_every_tensor(sharded_bf16_dir):
    index = json.loads((sharded_bf16_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_shapes(TINY))
    assert len(set(index["weight_map"].values())) > 1


def test_real_llada_8b_metadata_matches_the_shape_description():
    config = read_config(LLADA_8B_DIR, eot_token_id=126348)
    assert (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads) == (4096, 32, 32, 32)
    assert (config.mlp_hidden_size, config.embedding_size, config.mask_token_id) == (12288, 126464, 126336)
    assert config.eos_token_id == 126081 and config.rope_theta == 500000.0
    index = json.loads((LLADA_8B_DIR / "model.safetensors.index.json").read_text())
    shapes = hf_shapes(config)
    assert set(index["weight_map"]) == set(shapes)
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())  # stored as bf16
    assert total == index["metadata"]["total_size"]


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def drop_from_index(name):
    return lambda index: index["weight_map"].pop(name)


def fault_missing_tensor(d):
    edit_json(d / "model.safetensors.index.json", drop_from_index("model.transformer.blocks.1.q_proj.weight"))


def fault_unexpected_tensor(d):
    edit_json(d / "config.json", lambda c: c.update(n_layers=1))


def fault_config_contradicts_weights(d):
    edit_json(d / "config.json", lambda c: c.update(mlp_hidden_size=48))


def fault_truncated_shard(d):
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])


def fault_bad_index(d):
    (d / "model.safetensors.index.json").write_text("{not json")


def fault_missing_shard(d):
    sorted(d.glob("model-*.safetensors"))[0].unlink()


def fault_tensor_in_wrong_shard(d):
    def move(index):
        files = sorted(set(index["weight_map"].values()))
        name = next(n for n, f in index["weight_map"].items() if f == files[0])
        index["weight_map"][name] = files[1]
    edit_json(d / "model.safetensors.index.json", move)


def fault_shard_outside_the_directory(d):
    edit_json(d / "model.safetensors.index.json",
              lambda index: index["weight_map"].update({next(iter(index["weight_map"])): "../elsewhere.safetensors"}))


def fault_no_config(d):
    (d / "config.json").unlink()


def fault_bad_config(d):
    (d / "config.json").write_text("[1, 2")


def fault_unsupported_architecture(d):
    edit_json(d / "config.json", lambda c: c.update(weight_tying=True))


def fault_moe_architecture(d):
    """LLaDA-MoE's config says model_type "llada" like LLaDA-8B: only its architecture tells them apart, and
    its reader finds none of its own fields in LLaDA's config."""
    edit_json(d / "config.json", lambda c: c.update(architectures=["LLaDAMoEModelLM"], model_type="llada"))


def fault_dream_architecture(d):
    edit_json(d / "config.json", lambda c: c.update(architectures=["DreamModel"], model_type="Dream"))


def fault_unknown_architecture(d):
    edit_json(d / "config.json", lambda c: c.update(architectures=["RND1ForCausalLM"]))


def fault_malformed_architectures(d):
    edit_json(d / "config.json", lambda c: c.update(architectures="LLaDAModelLM"))


FAULTS = {
    fault_missing_tensor: "missing tensor model.transformer.blocks.1.q_proj.weight",
    fault_unexpected_tensor: "unexpected tensor model.transformer.blocks.1.",
    fault_config_contradicts_weights: "ff_proj.weight is bfloat16 [64, 32] but config.json implies float [48, 32]",
    fault_truncated_shard: "unreadable safetensors file",
    fault_bad_index: "not a valid safetensors index",
    fault_missing_shard: "shard model-00001-of-",
    fault_tensor_in_wrong_shard: "is listed in the index but not in this shard",
    fault_shard_outside_the_directory: "shard ../elsewhere.safetensors is not a file name in the model directory",
    fault_no_config: "no config.json",
    fault_bad_config: "not valid JSON",
    fault_unsupported_architecture: "weight_tying=True is not supported",
    fault_moe_architecture: "config.json lacks required field num_experts",
    fault_dream_architecture: "config.json lacks required field hidden_size",
    fault_unknown_architecture: "architecture 'RND1ForCausalLM', which llada-jax does not load "
                                "(supported: LLaDAModelLM, DreamModel, LLaDAMoEModelLM, LLaDA2MoeModelLM)",
    fault_malformed_architectures: "architectures must be a list of names",
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=lambda f: f.__name__)
def test_checkpoint_faults_give_one_line_errors(tmp_path, sharded_bf16_dir, fault):
    broken = tmp_path / "broken"
    shutil.copytree(sharded_bf16_dir, broken)
    fault(broken)
    with pytest.raises(LladaError) as err:
        llada_jax.load(broken)
    message = str(err.value)
    assert FAULTS[fault] in message and "\n" not in message


@pytest.mark.parametrize("fault", [fault_config_contradicts_weights, fault_missing_tensor, fault_unexpected_tensor,
                                   fault_truncated_shard], ids=lambda f: f.__name__)
def test_convert_refuses_what_would_not_load_and_writes_nothing(tmp_path, sharded_bf16_dir, fault, capsys):
    """`llada convert` checks names, dtypes and shapes from the headers before it writes, so it never says "loads
    in place" of a checkpoint the loader refuses."""
    from llada_jax.cli import main

    broken = shutil.copytree(sharded_bf16_dir, tmp_path / "broken")
    fault(broken)
    assert main(["convert", "--model", str(broken), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert FAULTS[fault] in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


# config.json values that used to load as something else (or be ignored): each is refused, naming the field.
CONFIG_FAULTS = [
    ({"d_model": 32.5}, "field d_model must be an integer, got 32.5"),
    ({"d_model": "32"}, "field d_model must be an integer, got '32'"),
    ({"n_heads": True}, "field n_heads must be an integer, got True"),
    ({"rope_theta": float("inf")}, "field rope_theta must be a finite number, got inf"),
    ({"rms_norm_eps": float("nan")}, "field rms_norm_eps must be a finite number, got nan"),
    ({"eos_token_id": -1}, "eos_token_id must be a token id >= 0, got -1"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ({"layer_norm_with_affine": False}, "layer_norm_with_affine=False is not supported"),
    ({"bias_for_layer_norm": True}, "bias_for_layer_norm=True is not supported"),
    ({"rope_full_precision": False}, "rope_full_precision=False is not supported"),
]


@pytest.mark.parametrize("change,words", CONFIG_FAULTS, ids=[next(iter(case[0])) + str(index)
                                                            for index, case in enumerate(CONFIG_FAULTS)])
def test_config_values_of_the_wrong_type_or_an_unsupported_variant_are_refused(tmp_path, change, words):
    model_dir = write_checkpoint(tmp_path / "model")
    edit_json(model_dir / "config.json", lambda c: c.update(change))
    with pytest.raises(LladaError) as err:
        llada_jax.load(model_dir)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_integral_floats_and_nulls_read_as_their_values(tmp_path):
    model_dir = write_checkpoint(tmp_path / "model")
    edit_json(model_dir / "config.json", lambda c: c.update(d_model=float(c["d_model"]), clip_qkv=None))
    assert type(llada_jax.load(model_dir).config.d_model) is int


def test_single_file_truncation_is_caught(tmp_path):
    model_dir = write_checkpoint(tmp_path / "single")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(LladaError, match="unreadable safetensors file"):
        llada_jax.load(model_dir)


def test_weights_equal_what_was_saved(tiny_dir, tiny_model):
    stored = read_all(tiny_dir)
    for name, value in params_to_hf(tiny_model.params, TINY).items():
        np.testing.assert_array_equal(np.asarray(value, np.float64), stored[name])


def test_small_vocabulary_without_special_ids_in_config_loads(tmp_path):
    """A vocab-512 checkpoint whose config names only its mask id: EOS/EoT default to the 8B ids, which
    lie outside this vocabulary, so the EOS options simply have nothing to act on."""
    model_dir = write_checkpoint(tmp_path / "small")
    edit_json(model_dir / "config.json", lambda c: (c.pop("eos_token_id"), c.pop("pad_token_id")))
    model = llada_jax.load(model_dir)
    assert model.config.mask_token_id == 500 and model.config.eos_token_id == 126081
    plain = llada_jax.generate(model, np.arange(3, 9), gen_length=8, block_length=8, steps=8)
    guarded = llada_jax.generate(model, np.arange(3, 9), gen_length=8, block_length=8, steps=8,
                                 logits_eos_inf=True, confidence_eos_eot_inf=True)
    assert plain.output_ids.tolist() == guarded.output_ids.tolist()
