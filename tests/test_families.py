"""Dream and LLaDA-MoE: checkpoints in their exact HF layout load, run the forward the float64 oracle states
from their modeling code, and decode as the reference loops do; what a family cannot carry is a one-line error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.model.config import LLaDAConfig, read_config
from llada_jax.model.params import hf_to_params
from llada_jax.quant.quantize import HostQuantized, QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.weights.checkpoint import save_hf
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from llada_jax.weights.weights_io import iter_tensors
from policies.dream_schedule import dream_timesteps
from tests import dream_reference, reference
from tests.conftest import LLADA_8B_DIR, read_all, write_checkpoint

# Grouped K/V and each family's deltas; vocab 256 with the mask id inside it.
DREAM = LLaDAConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=48, vocab_size=256,
                    embedding_size=256, max_sequence_length=128, rope_theta=1e6, rms_norm_eps=1e-6,
                    mask_token_id=250, eos_token_id=251, eot_token_id=251, family="dream", qkv_bias=True,
                    logits_shift=True)
MOE = LLaDAConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=16, vocab_size=256,
                  embedding_size=256, max_sequence_length=128, rope_theta=50000.0, rms_norm_eps=1e-5,
                  mask_token_id=250, eos_token_id=251, eot_token_id=251, family="llada-moe", qk_norm=True,
                  n_experts=8, experts_per_token=3)
CONFIGS = {"dream": DREAM, "llada-moe": MOE}

# The tensor names of layer 0 as the families' own checkpoints spell them (HF `state_dict` keys).
DREAM_LAYER = {f"model.layers.0.{name}" for name in (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
    "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
MOE_LAYER = {f"model.layers.0.{name}" for name in (
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate.weight")} | {f"model.layers.0.mlp.experts.{e}.{m}_proj.weight" for e in range(8)
                           for m in ("gate", "up", "down")}
TOP = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family_dir(request, tmp_path_factory):
    config = CONFIGS[request.param]
    return config, write_checkpoint(tmp_path_factory.mktemp("family") / request.param, config, std=0.3)


@pytest.fixture(scope="module")
def family_model(family_dir):
    config, path = family_dir
    return config, llada_jax.load(path), read_all(path)


def test_checkpoints_use_the_hf_names_and_read_back(family_dir):
    config, path = family_dir
    names = set(read_all(path))
    layer0 = {name for name in names if name.startswith("model.layers.0.")}
    assert layer0 == (DREAM_LAYER if config.family == "dream" else MOE_LAYER)
    assert TOP <= names and len(names) == len(TOP) + 2 * len(layer0)
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == [{"dream": "DreamModel", "llada-moe": "LLaDAMoEModelLM"}[config.family]]
    assert read_config(path) == config


@settings(max_examples=8)
@given(batch=st.integers(1, 2), length=st.integers(1, 24), seed=st.integers(0, 10_000))
def test_logits_match_the_float64_oracle(family_model, batch, length, seed):
    config, model, weights = family_model
    ids = np.random.default_rng(seed).integers(0, config.embedding_size, (batch, length))
    expected = reference.forward(weights, config, ids)[0]
    got = llada_jax.logits(model, ids)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-4, atol=2e-4)


# LLaDA's decoding on any family: no top-k filter, blocks that start by their rule (Dream's defaults differ).
LLADA_CONVENTIONS = {"top_k": 0, "first_token": False}


@settings(max_examples=6)
@given(policy=st.sampled_from(["vanilla", "prefix-cache", "dual-cache"]), threshold=st.sampled_from([None, 0.2]),
       prompt_len=st.integers(1, 12), blocks=st.integers(1, 2), steps_per_block=st.sampled_from([2, 4]),
       seed=st.integers(0, 10_000))
def test_llada_decoders_match_the_reference_loops(family_model, policy, threshold, prompt_len, blocks,
                                                  steps_per_block, seed):
    """LLaDA's and Fast-dLLM's loops over each family's forward (Dream's windows shift within themselves)."""
    config, model, weights = family_model
    prompt = np.random.default_rng(seed).integers(0, config.mask_token_id, prompt_len)
    try:
        expected, nfe = reference.generate(weights, config, prompt, 8 * blocks, 8, steps_per_block * blocks, policy,
                                           threshold)
    except reference.NeverEnds:
        reject()  # the reference never ends on this case (ours ends the block: `decisions.block_going`)
    result = llada_jax.generate(model, prompt, gen_length=8 * blocks, block_length=8,
                                steps=steps_per_block * blocks, policy=policy, threshold=threshold, loop="host",
                                **LLADA_CONVENTIONS)
    assert result.output_ids.tolist() == expected.tolist() and result.nfe == nfe


BAD_FIELDS = [
    ("dream", {"tie_word_embeddings": True}, "tie_word_embeddings"),
    ("dream", {"hidden_act": "gelu"}, "hidden_act"),
    ("dream", {"intermediate_size": None}, "intermediate_size"),
    ("llada-moe", {"moe_layer_freq": [0, 1]}, "moe_layer_freq"),
    ("llada-moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ("llada-moe", {"attention_bias": True}, "attention_bias"),
    ("llada-moe", {"num_experts_per_tok": 9}, "experts per token"),
    ("llada-moe", {"num_experts": 0, "num_experts_per_tok": 0}, "num_experts=0: LLaDAMoEModelLM needs at least one"),
    ("llada-moe", {"eos_token_id": None}, "eos_token_id"),
    ("llada-moe", {"rope_theta": "fast"}, "rope_theta must be a finite number, got 'fast'"),
    ("dream", {"num_key_value_heads": [4]}, "num_key_value_heads must be an integer, got"),
    ("dream", {"mask_token_id": 251}, "mask_token_id=251 is also the end-of-text id"),
    ("dream", {"hidden_size": 1e300, "num_attention_heads": 1, "num_key_value_heads": 1},
     "config field d_model must be at most 2147483647, got 1e\\+300"),
    ("dream", {"num_hidden_layers": 10**9}, "config field n_layers must be at most 4096, got 1e\\+09"),
    ("llada-moe", {"num_experts": 10**6}, "config field n_experts must be at most 4096"),
]


@pytest.mark.parametrize("family, change, named", BAD_FIELDS)
def test_unsupported_family_options_are_one_line_errors(family, change, named):
    raw = dict(CONFIGS[family].to_hf_dict(), **change)
    with pytest.raises(LladaError, match=named) as error:
        LLaDAConfig.from_hf_dict(raw)
    assert "\n" not in str(error.value)


def test_llada_1_5_loads_as_llada(tmp_path):
    """LLaDA 1.5 is LLaDA-8B's architecture with new weights: its config.json is LLaDA-8B-Instruct's."""
    raw = json.loads((LLADA_8B_DIR / "config.json").read_text())
    assert raw["architectures"] == ["LLaDAModelLM"]
    config = LLaDAConfig.from_hf_dict(dict(raw, _name_or_path="GSAI-ML/LLaDA-1.5"))
    assert config.family == "llada" and config.n_layers == 32 and not config.n_experts


@pytest.mark.slow
def test_staged_runs_give_the_resident_tokens(family_model, family_dir, tmp_path):
    """Every family streams its layers through a budget smaller than its weights (an MoE layer with every
    expert's matrices in its stage), float and int8 alike, with the resident model's tokens."""
    _, model, _ = family_model
    path = family_dir[1]
    quantized = quantize_checkpoint(path, tmp_path / "q", QuantScheme(8))
    for resident, directory in ((model, path), (llada_jax.load(quantized), quantized)):
        staged = llada_jax.load(directory, device_memory_budget=resident.weight_bytes - 1)
        assert staged.staged is not None
        for policy in ("vanilla", "dual-cache"):
            options = dict(gen_length=16, block_length=8, steps=8, policy=policy)
            assert (llada_jax.generate(staged, np.arange(5), **options).output_ids.tolist()
                    == llada_jax.generate(resident, np.arange(5), **options).output_ids.tolist())


@pytest.mark.parametrize("scheme", [QuantScheme(8), QuantScheme(4, 16)], ids=["int8", "int4-g16"])
@pytest.mark.slow
def test_quantized_families_run_as_their_dequantized_twins(family_dir, scheme, tmp_path):
    """`llada quantize` on each family (MoE experts one by one, its router float): the quantized model computes
    what a float model of its dequantized weights computes, on the host and compiled loops."""
    config, path = family_dir
    quantized = quantize_checkpoint(path, tmp_path / "q", scheme)
    tensors = {name: value.dequantize() if isinstance(value, HostQuantized) else value
               for name, value in iter_tensors(quantized, config)}
    router = "model.layers.0.mlp.gate.weight"
    assert not config.n_experts or not isinstance(dict(iter_tensors(quantized, config))[router], HostQuantized)
    twin = llada_jax.load(save_hf(hf_to_params(tensors, config), config, tmp_path / "twin"))
    model = llada_jax.load(quantized)
    ids = np.random.default_rng(3).integers(0, 250, (2, 20))
    want = llada_jax.logits(twin, ids)
    np.testing.assert_allclose(llada_jax.logits(model, ids), want, atol=1e-4 * np.abs(want).max(), rtol=0)
    options = dict(gen_length=16, block_length=8, steps=8, policy="dual-cache", threshold=0.2, **LLADA_CONVENTIONS)
    expected = llada_jax.generate(twin, np.arange(1, 7), loop="host", **options).output_ids.tolist()
    for loop in ("host", "compiled"):
        assert llada_jax.generate(model, np.arange(1, 7), loop=loop, **options).output_ids.tolist() == expected
    if scheme.bits == 8:  # W8A8: activations quantized per position, the same tokens on both loops
        w8a8 = llada_jax.load(quantized, activations="int8")
        host, compiled = (llada_jax.generate(w8a8, np.arange(1, 7), loop=loop, **options).output_ids.tolist()
                          for loop in ("host", "compiled"))
        assert host == compiled



@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("dream") / "dream", DREAM, std=0.3)
    return llada_jax.load(path), read_all(path)


# (our top_k, the reference's): by default Dream's schedule filters to the top 50 as its reference does under
# transformers 4.x; 0 turns the filter off (the reference called with top_k=None).
TOP_K = [(None, 50), (0, None), (5, 5)]


@settings(max_examples=14)
@given(alg=st.sampled_from(sorted(dream_reference.ALGORITHMS)), eps=st.sampled_from([1e-3, 1e-2, 0.0]),
       prompt_len=st.integers(1, 12), new=st.sampled_from([4, 8, 16]), steps=st.sampled_from([1, 3, 8, 16]),
       top_k=st.sampled_from(TOP_K), top_p=st.sampled_from([None, 0.9, 0.3]), seed=st.integers(0, 10_000))
def test_dream_diffusion_generate_matches_its_reference(dream, alg, eps, prompt_len, new, steps, top_k, top_p, seed):
    """Dream's own decoders: `diffusion_generate(alg, steps, eps, top_k, top_p)` at temperature 0 is vanilla over
    one block with Dream's schedule, filters and confidence."""
    model, weights = dream
    prompt = np.random.default_rng(seed).integers(0, DREAM.mask_token_id, prompt_len)
    expected, nfe = dream_reference.diffusion_generate(weights, DREAM, prompt, new, steps, eps, alg, top_k[1], top_p)
    result = llada_jax.generate(model, prompt, gen_length=new, block_length=new, steps=steps, policy="vanilla",
                                remasking=dream_reference.ALGORITHMS[alg], schedule=f"dream:{eps}", top_k=top_k[0],
                                top_p=top_p)
    assert result.output_ids.tolist() == expected.tolist() and result.nfe == nfe


@settings(max_examples=12)
@given(dual=st.booleans(), threshold=st.sampled_from([None, 0.3, 0.9]), eps=st.sampled_from([1e-3, 0.0]),
       prompt_len=st.integers(1, 10), blocks=st.integers(1, 3), block_length=st.sampled_from([4, 8]),
       steps_per_block=st.sampled_from([2, 3, 4, 8]), top_k=st.sampled_from(TOP_K), seed=st.integers(0, 10_000))
def test_fast_dllm_dream_decoder_matches_its_reference(dream, dual, threshold, eps, prompt_len, blocks, block_length,
                                                        steps_per_block, top_k, seed):
    """Fast-dLLM's Dream decoder: prefix or dual cache, each block begun with its first token, then the threshold
    rule or Dream's schedule on the negative entropy (Dream's defaults for a cached policy)."""
    model, weights = dream
    prompt = np.random.default_rng(seed).integers(0, DREAM.mask_token_id, prompt_len)
    gen_length, steps = blocks * block_length, blocks * steps_per_block
    try:
        expected, nfe = dream_reference.fast_dllm_generate(weights, DREAM, prompt, gen_length, block_length, steps,
                                                           dual, threshold, eps, top_k[1])
    except reference.NeverEnds:
        reject()  # the reference never ends on this case (ours ends the block: `decisions.block_going`)
    result = llada_jax.generate(model, prompt, gen_length=gen_length, block_length=block_length, steps=steps,
                                policy="dual-cache" if dual else "prefix-cache", threshold=threshold,
                                remasking="low_confidence" if threshold else "entropy", schedule=f"dream:{eps}",
                                top_k=top_k[0])
    assert result.output_ids.tolist() == expected.tolist() and result.nfe == nfe


def test_dream_timesteps_are_torch_linspace_in_float32():
    """Both halves, and values where a float32 step times i rounded twice differs from torch's one rounding."""
    for steps in (1, 2, 7, 8, 64, 255, 512):
        for eps in (1e-3, 1e-4, 0.0, 0.05):
            np.testing.assert_array_equal(dream_timesteps(steps, eps),
                                          dream_reference.torch_linspace_float32(1.0, eps, steps + 1))
    assert dream_timesteps(8, 1e-3)[3] == np.float32(0.625375)  # torch's value; (1 + step * 3) in float32 is not


@pytest.mark.parametrize("bad, named", [("dream:x", "bad eps"), ("dream:1.5", "eps must be in"),
                                        ("cosine", "unknown schedule"), ("llada:0.1", "unknown schedule")])
def test_bad_schedules_are_one_line_errors(dream, bad, named):
    for threshold in (None, 0.9):  # checked even where the threshold rule decides
        with pytest.raises(LladaError, match=named):
            llada_jax.generate(dream[0], np.arange(3), gen_length=8, block_length=8, steps=4, schedule=bad,
                               threshold=threshold)


@pytest.mark.parametrize("policy, threshold", [("vanilla", None), ("prefix-cache", None), ("dual-cache", 0.2),
                                               ("dual-cache+speculative", 0.2)])
def test_compiled_loop_gives_the_host_loop_tokens(family_model, policy, threshold):
    config, model, _ = family_model
    options = dict(gen_length=16, block_length=8, steps=8, policy=policy, threshold=threshold, **LLADA_CONVENTIONS)
    host = llada_jax.generate(model, np.arange(1, 7), loop="host", **options)
    compiled = llada_jax.generate(model, np.arange(1, 7), loop="compiled", **options)
    assert compiled.output_ids.tolist() == host.output_ids.tolist() and compiled.nfe == host.nfe


def test_family_bundles_refuse_a_compiled_loop(family_dir, tmp_path):
    """Dream's loop follows its own conventions on the host; IREE 3.13 fails on an MoE's decode loop."""
    from llada_jax.cli import main

    _, path = family_dir
    assert main(["compile", "--model", str(path), "--target", "host", "--out", str(tmp_path / "b"), "--max-len", "32",
                 "--gen-length", "16", "--block-length", "8"]) != 0
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["resident", "staged"])
def test_iree_host_bundle_gives_the_xla_tokens(family_dir, family_model, tmp_path, staged):
    """Resident, and streamed layer by layer by the program through a budget below the weights
    (`lowering.stage_ring`: LLaDA2's dense first layer and MoE layers are stages of two sizes)."""
    from llada_jax.backends.iree import load_bundle
    from llada_jax.bundle_runner import bundle_runner
    from lowering.bundle import compile_bundle

    (_, path), (_, model, _) = family_dir, family_model
    budget = model.weight_bytes - 1 if staged else None
    bundle = compile_bundle(path, "host", tmp_path / "bundle", max_len=32, window=32, device_memory_budget=budget)
    assert (load_bundle(bundle).manifest["streamed"] is not None) == staged
    _, _, generate_bundled = bundle_runner(bundle)
    for policy, threshold in (("vanilla", None), ("prefix-cache", None), ("dual-cache", 0.2)):
        options = dict(gen_length=16, block_length=8, steps=8, policy=policy, threshold=threshold, loop="host",
                       **LLADA_CONVENTIONS)
        assert (generate_bundled(np.arange(1, 7), **options).output_ids.tolist()
                == llada_jax.generate(model, np.arange(1, 7), **options).output_ids.tolist())
