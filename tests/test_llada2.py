"""LLaDA2.0 / LLaDA2.1 (`LLaDA2MoeModelLM`): tiny checkpoints in the exact HF layout load, their logits match
the float64 oracle of the published modeling code under its block-causal mask, both published samplers are
reproduced token for token at temperature 0, and the exact block cache gives the uncached tokens. The host loop
runs these; the compiled loop is the host loop pass for pass (`tests/test_block_loop.py`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.model.config import LLaDAConfig, read_config
from llada_jax.model.params import hf_shapes, init_params
from llada_jax.system.errors import LladaError
from llada_jax.weights.checkpoint import save_hf
from tests import llada2_reference as ref
from tests.conftest import write_checkpoint

# One dense layer then two MoE layers; 8 experts in 4 groups, 2 groups kept, top 2; a shared expert; 4 of each
# head's 8 dims rotate; GQA 4 query heads over 2 kv-heads.
CONFIG = LLaDAConfig(
    family="llada2", d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden_size=16, vocab_size=96,
    embedding_size=96, max_sequence_length=128, rope_theta=600000.0, rms_norm_eps=1e-6, mask_token_id=90,
    eos_token_id=91, eot_token_id=91, qk_norm=True, rotary_dim=4, n_experts=8, experts_per_token=2,
    dense_layers=1, dense_hidden_size=48, shared_expert_size=16, router="sigmoid-grouped", expert_groups=4,
    groups_kept=2, routed_scaling=2.5, block_causal=True)

# config.json as the reference's `LLaDA2MoeConfig.save_pretrained` writes it (every attribute), LLaDA2.0-mini's
# values scaled down.
REFERENCE_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_act": "silu", "use_qkv_bias": False, "use_qk_norm": True, "use_bias": False, "rms_norm_eps": 1e-06,
    "norm_head": False, "tie_word_embeddings": False, "embedding_dropout": 0.0, "attention_dropout": 0.0,
    "output_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 128, "rope_theta": 600000,
    "use_cache": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "head_dim": 8, "rope_scaling": None, "pad_token_id": 91, "num_experts": 8, "num_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 16,
    "first_k_dense_replace": 1, "output_router_logits": False, "routed_scaling_factor": 2.5,
    "partial_rotary_factor": 0.5, "norm_topk_prob": True, "score_function": "sigmoid", "router_dtype": "fp32",
    "moe_router_enable_expert_bias": True, "rotary_dim": 4, "mask_token_id": 90, "eos_token_id": 91,
    "torch_dtype": "float32",
}


def write_tiny(directory):
    """The tiny model in the HF layout, its config.json the reference's own."""
    out = write_checkpoint(directory / "tiny", CONFIG, std=0.4)
    (out / "config.json").write_text(json.dumps(REFERENCE_CONFIG, indent=2))
    return out


def float64_weights(checkpoint) -> dict:
    from safetensors.numpy import load_file

    return {name: value.astype(np.float64) for name, value in load_file(checkpoint / "model.safetensors").items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("llada2"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return llada_jax.load(checkpoint)


@pytest.fixture(scope="module")
def weights(checkpoint):
    return float64_weights(checkpoint)


def test_the_reference_config_reads_as_the_model_and_writes_back(checkpoint, tmp_path):
    assert read_config(checkpoint) == CONFIG
    assert LLaDAConfig.from_hf_dict(CONFIG.to_hf_dict()) == CONFIG
    names = set(hf_shapes(CONFIG))
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert {"model.layers.1.attention.query_key_value.weight", "model.layers.1.mlp.gate.expert_bias",
            "model.layers.2.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.layers.1.attention.query_layernorm.weight", "model.word_embeddings.weight"} <= names
    assert hf_shapes(CONFIG)["model.layers.1.attention.query_key_value.weight"] == ((4 + 2 * 2) * 8, 32)
    save_hf(init_params(CONFIG), CONFIG, tmp_path / "again")
    assert read_config(tmp_path / "again") == CONFIG


@pytest.mark.parametrize("change, named", [
    ({"use_bias": True}, "use_bias"), ({"use_qkv_bias": True}, "use_qkv_bias"), ({"norm_head": True}, "norm_head"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"), ({"rope_scaling": {"type": "linear"}}, "rope_scaling"),
    ({"n_group": 3}, "n_group"), ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"head_dim": 16}, "head_dim"), ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_what_the_reference_would_compute_otherwise_is_refused_in_one_line(change, named):
    with pytest.raises(LladaError, match=named) as refused:
        LLaDAConfig.from_hf_dict({**REFERENCE_CONFIG, **change})
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("length, block_length", [(7, 4), (16, 8), (13, 32)])
def test_logits_match_the_float64_oracle_under_the_block_causal_mask(model, weights, length, block_length):
    ids = np.random.default_rng(length).integers(0, 90, (2, length))
    ours = llada_jax.logits(model, ids, block_length=block_length)
    expected = ref.forward(weights, CONFIG, ids, block_length)
    np.testing.assert_allclose(ours, expected, atol=2e-4, rtol=2e-4)


def test_block_causal_logits_need_a_block_length(model):
    with pytest.raises(LladaError, match="block-causal"):
        llada_jax.logits(model, np.zeros((1, 4), int))


PROMPTS = st.lists(st.integers(0, 89), min_size=1, max_size=11)


@settings(max_examples=40)
@given(prompt=PROMPTS, block=st.sampled_from([4, 8]), gen=st.integers(1, 12), steps=st.integers(1, 5),
       threshold=st.sampled_from([None, 0.05, 0.2]), minimal_topk=st.sampled_from([1, 3]))
def test_llada2_0_decoder_matches_the_reference_sampler(model, weights, prompt, block, gen, steps, threshold,
                                                         minimal_topk):
    prompt, gen = np.array(prompt), max(gen, minimal_topk)
    result = llada_jax.generate(model, prompt, gen_length=gen, block_length=block, steps=steps, threshold=threshold,
                                minimal_topk=minimal_topk, policy="dual-cache", loop="host")
    canvas, nfe = ref.sample_llada2(weights, CONFIG, prompt, gen, block, steps,
                                    threshold=1.0 if threshold is None else threshold, minimal_topk=minimal_topk)
    assert result.output_ids.tolist() == canvas[len(prompt): len(prompt) + gen].tolist()
    assert result.nfe == nfe


@settings(max_examples=40)
@given(prompt=PROMPTS, block=st.sampled_from([4, 8]), gen=st.integers(1, 12),
       threshold=st.sampled_from([0.05, 0.3, 0.99]), editing=st.sampled_from([0.05, 0.2, 0.9]),
       post=st.integers(0, 3), per_pass=st.integers(1, 3))
def test_llada2_1_decoder_matches_the_reference_sampler(model, weights, prompt, block, gen, threshold, editing, post,
                                                         per_pass):
    prompt = np.array(prompt)
    result = llada_jax.generate(model, prompt, gen_length=gen, block_length=block, steps=block, threshold=threshold,
                                editing_threshold=editing, max_post_steps=post, num_to_transfer=per_pass,
                                policy="dual-cache", loop="host")
    reference = ref.sample_llada21(weights, CONFIG, prompt, gen, block, threshold=threshold,
                                   editing_threshold=editing, max_post_steps=post, num_to_transfer=per_pass)
    if reference is None:  # the reference never ends: ours stops a block whose state came back
        assert result.stats["bounded_blocks"] >= 1
        return
    canvas, nfe = reference
    assert result.output_ids.tolist() == canvas[len(prompt): len(prompt) + gen].tolist()
    assert result.nfe == nfe and result.stats["bounded_blocks"] == 0


@settings(max_examples=30)
@given(prompt=PROMPTS, block=st.sampled_from([2, 4, 8]), gen=st.integers(1, 16), editing=st.sampled_from([None, 0.3]))
def test_the_block_cache_gives_the_uncached_tokens(model, prompt, block, gen, editing):
    options = dict(gen_length=gen, block_length=block, steps=block, threshold=0.3, editing_threshold=editing)
    cached = llada_jax.generate(model, np.array(prompt), policy="dual-cache", loop="host", **options)
    uncached = llada_jax.generate(model, np.array(prompt), policy="vanilla", **options)
    assert cached.output_ids.tolist() == uncached.output_ids.tolist()
    confidences = [[c for record in result.trace for c in record.confidence] for result in (cached, uncached)]
    assert confidences[0] == pytest.approx(confidences[1], abs=1e-5)
    assert cached.stats["cache_passes"] <= uncached.stats["cache_passes"]


@pytest.mark.parametrize("options, named", [
    ({"policy": "dual-cache+revision"}, "LLaDA2.1's editing decoder"),
    ({"policy": "dual-cache+speculative:1:0"}, "draft threshold must be in"),
    ({"num_to_transfer": 0}, "loops forever"),
    ({"gen_length": 120}, "rounded up to whole blocks"),
    ({"gen_length": 2, "minimal_topk": 3}, "leaves no step"),
    ({"editing_threshold": float("nan")}, "editing_threshold must be a finite number"),
])
def test_bad_block_settings_are_one_line_errors(model, options, named):
    settings = {"gen_length": 8, "block_length": 8, "steps": 8, "policy": "dual-cache", **options}
    with pytest.raises(LladaError, match=named):
        llada_jax.generate(model, np.arange(9), **settings)


def test_block_options_are_refused_on_other_families(tiny_model):
    with pytest.raises(LladaError, match="editing_threshold is LLaDA2's"):
        llada_jax.generate(tiny_model, np.arange(4), gen_length=8, block_length=8, steps=8, editing_threshold=0.5)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The family over the embedded model's tokenizer (its vocabulary, mask and end ids), random weights."""
    import dataclasses
    import shutil

    from llada_jax.system.locations import EMBEDDED_DIR

    embedded = llada_jax.load(EMBEDDED_DIR).config
    config = dataclasses.replace(CONFIG, vocab_size=embedded.vocab_size, embedding_size=embedded.embedding_size,
                                 mask_token_id=embedded.mask_token_id, eos_token_id=embedded.eos_token_id,
                                 eot_token_id=embedded.eot_token_id)
    path = write_checkpoint(tmp_path_factory.mktemp("chat") / "llada2", config, std=0.3)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(EMBEDDED_DIR / name, path / name)
    return llada_jax.load(path)


@pytest.mark.slow
def test_lm_eval_adapter_decodes_with_the_family_default_and_gives_block_diffusion_bound(chat_model):
    """Through lm-eval's adapter: with no policy named, answers as the family's default decoder (the command
    line's: the block cache at threshold 0.95); the BD3LM Monte Carlo bound and greedy check, blocks of
    `block_length`."""
    from lm_eval.api.instance import Instance

    from eval.lm_harness import LladaLM
    from eval.mc_likelihood import block_greedy_answer, mc_log_likelihood, request_rng
    from llada_jax.weights.tokenizer import answer_text

    lm = LladaLM(pretrained=str(chat_model.path), mc_num=8, mc_batch_size=4, block_length=4)
    assert (lm.policy, lm.threshold) == ("dual-cache", 0.95)
    [answer] = lm.generate_until([Instance("generate_until", {}, ("sort 3 1 2", {"max_gen_toks": 8}), 0)])
    alone = llada_jax.generate(chat_model, np.array(chat_model.tokenizer.encode("sort 3 1 2")), gen_length=8,
                               block_length=4, steps=4, policy="dual-cache", threshold=0.95)
    assert answer == answer_text(chat_model.tokenizer, alone.output_ids, chat_model.config)
    pairs = [("sort 3 1 2", " 1 2 3"), ("reverse abc", " cba")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (ll, greedy) in zip(pairs, results):
        prefix, target = lm.encode_pair(context, continuation)
        rng = request_rng(lm.seed, context, continuation)
        assert ll == mc_log_likelihood(chat_model, prefix, target, 8, 4, rng, block_length=4) and np.isfinite(ll)
        assert greedy == (block_greedy_answer(chat_model, prefix, target, 4) == target)


@pytest.mark.slow
def test_llada_serve_answers_as_generate_alone(chat_model):
    import openai

    from llada_jax.server.requests import Defaults
    from llada_jax.weights.tokenizer import answer_text
    from tests import test_server

    defaults = Defaults(gen_length=16, block_length=8, steps=8, policy="dual-cache", threshold=0.95,
                        block_options=(("editing_threshold", 0.5),))
    questions = test_server.QUESTIONS[:2]
    with test_server.serving(chat_model, defaults=defaults) as (url, _):
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        answers = [client.chat.completions.create(model=test_server.NAME, messages=[
            {"role": "user", "content": question}]).choices[0].message.content for question in questions]
    tokenizer = chat_model.tokenizer
    alone = [answer_text(tokenizer, llada_jax.generate(
        chat_model, np.array(tokenizer.encode(tokenizer.chat_prompt(question))), gen_length=16, block_length=8,
        steps=8, policy="dual-cache", threshold=0.95, editing_threshold=0.5).output_ids, chat_model.config)
        for question in questions]
    assert answers == alone


@pytest.mark.slow
def test_llada_generate_takes_the_family_defaults(chat_model, capsys):
    from llada_jax.cli import main

    assert main(["generate", "--model", str(chat_model.path), "--prompt-ids", "1,2,3", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    expected = llada_jax.generate(chat_model, np.array([1, 2, 3]), gen_length=32, block_length=8, steps=8,
                                  policy="dual-cache", threshold=0.95)
    assert row["output_ids"] == expected.output_ids.tolist() and row["nfe"] == expected.nfe
    # a speculation flag without --policy speculates on the family's default decoder
    assert main(["generate", "--model", str(chat_model.path), "--prompt-ids", "1,2,3", "--json", "--lookahead", "2",
                 "--draft-threshold", "0.3"]) == 0
    row = json.loads(capsys.readouterr().out)
    speculated = llada_jax.generate(chat_model, np.array([1, 2, 3]), gen_length=32, block_length=8, steps=8,
                                    policy="dual-cache+speculative:2:0.3", threshold=0.95)
    assert speculated.nfe != expected.nfe  # the drafts save passes: dropping the flags would show
    assert row["output_ids"] == speculated.output_ids.tolist() and row["nfe"] == speculated.nfe
    assert main(["generate", "--model", str(chat_model.path), "--prompt-ids", "1,2,3", "--policy",
                 "dual-cache+revision"]) == 1
    assert "--editing-threshold" in capsys.readouterr().err


@pytest.mark.slow
def test_staged_runs_give_the_resident_tokens(model, checkpoint, tmp_path):
    """Streamed through a budget below the weights: the dense first layer and the MoE layers are stages of
    their own shapes; float and int8 alike, the resident tokens (2.0 and 2.1)."""
    from llada_jax.quant.quantize import QuantScheme
    from llada_jax.weights.quantize_checkpoint import quantize_checkpoint

    quantized = quantize_checkpoint(checkpoint, tmp_path / "q8", QuantScheme(8))
    for resident, directory in ((model, checkpoint), (llada_jax.load(quantized), quantized)):
        staged = llada_jax.load(directory, device_memory_budget=resident.weight_bytes - 1)
        assert staged.staged is not None
        for editing in (None, 0.3):
            options = dict(gen_length=12, block_length=4, steps=4, threshold=0.3, editing_threshold=editing,
                           policy="dual-cache")
            assert (llada_jax.generate(staged, np.arange(5), **options).output_ids.tolist()
                    == llada_jax.generate(resident, np.arange(5), **options).output_ids.tolist())


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_llada2_runs_as_its_dequantized_twin(checkpoint, bits, tmp_path):
    """Per expert, the shared expert and the fused q/k/v quantized; the router and expert_bias stay float."""
    from llada_jax.model.params import hf_to_params
    from llada_jax.quant.quantize import HostQuantized, QuantScheme
    from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
    from llada_jax.weights.weights_io import iter_tensors

    quantized = quantize_checkpoint(checkpoint, tmp_path / "q", QuantScheme(bits, 8 if bits == 4 else None))
    stored = dict(iter_tensors(quantized, CONFIG))
    assert isinstance(stored["model.layers.1.mlp.experts.3.up_proj.weight"], HostQuantized)
    assert isinstance(stored["model.layers.1.attention.query_key_value.weight"], HostQuantized)
    assert not isinstance(stored["model.layers.1.mlp.gate.weight"], HostQuantized)
    tensors = {name: value.dequantize() if isinstance(value, HostQuantized) else value
               for name, value in stored.items()}
    twin = llada_jax.load(save_hf(hf_to_params(tensors, CONFIG), CONFIG, tmp_path / "twin"))
    model = llada_jax.load(quantized)
    options = dict(gen_length=12, block_length=4, steps=4, threshold=0.3, policy="dual-cache")
    assert (llada_jax.generate(model, np.arange(1, 7), **options).output_ids.tolist()
            == llada_jax.generate(twin, np.arange(1, 7), **options).output_ids.tolist())


@pytest.mark.slow
def test_iree_host_bundle_gives_the_xla_tokens(model, checkpoint, tmp_path, capsys, monkeypatch):
    """Block steps through an IREE host bundle, resident and streamed (no compiled loop: this float checkpoint's
    experts run in loops, which IREE 3.13 fails on; a one-line refusal without --no-loop)."""
    from llada_jax.bundle_runner import bundle_runner
    from llada_jax.cli import main
    from lowering.bundle import compile_bundle

    assert main(["compile", "--model", str(checkpoint), "--target", "host", "--out", str(tmp_path / "looped"),
                 "--max-len", "32", "--gen-length", "12", "--block-length", "4"]) == 1
    error = capsys.readouterr().err
    assert "block-diffusion loop only where the experts are stacked on our routed kernels" in error
    assert len(error.splitlines()) == 1
    assert main(["compile", "--model", str(checkpoint), "--target", "host", "--out", str(tmp_path / "long"),
                 "--max-len", "32", "--block-length", "40", "--no-loop"]) == 1
    assert "--block-length must be in [1, --max-len 32], got 40" in capsys.readouterr().err
    # Resident in the bundle's archive, the experts stacked; resident in the checkpoint's files, a loop per expert;
    # streamed by the program through a budget below the weights: the dense first layer and the MoE layers are
    # stages of two sizes in one ring (`lowering.stage_ring`), the experts stacked.
    monkeypatch.setattr("lowering.bundle_layout.SLOW_EXPERT_LOOPS", 1)
    for name, budget, copied in (("resident", None, True), ("linked", None, False),
                                 ("streamed", model.weight_bytes - 1, True)):
        bundle = compile_bundle(checkpoint, "host", tmp_path / name, max_len=32, window=32,
                                device_memory_budget=budget, block_length=8, copy_weights=copied)
        noted = "this bundle's steps hold 16 expert loops" in capsys.readouterr().err
        assert noted == (not copied)  # stacked, the steps hold none
        stacks = [p["shape"] for p in json.loads((bundle / "manifest.json").read_text())["parameters"]
                  if p["name"] == "blocks.1.experts_gate.weight"]
        assert stacks == ([[CONFIG.n_experts, CONFIG.mlp_hidden_size, CONFIG.d_model]] if name == "resident" else [])
        _, _, generate_bundled = bundle_runner(bundle)
        for editing in (None, 0.3):
            options = dict(gen_length=12, block_length=8, steps=4, threshold=0.3, editing_threshold=editing,
                           policy="dual-cache", loop="host")
            assert (generate_bundled(np.arange(1, 7), **options).output_ids.tolist()
                    == llada_jax.generate(model, np.arange(1, 7), **options).output_ids.tolist())
        with pytest.raises(LladaError, match="cannot mask"):  # drafts need a per-query mask: refused up front
            generate_bundled(np.arange(1, 7), gen_length=12, block_length=8, steps=4, loop="host",
                             policy="dual-cache+speculative:1")
        with pytest.raises(LladaError, match="block steps of --block-length 8, not 16"):
            generate_bundled(np.arange(1, 7), gen_length=12, block_length=16, steps=4, loop="host")


@pytest.fixture(scope="module")
def block_bundle(checkpoint, tmp_path_factory):
    """A host bundle holding block diffusion's steps for blocks of 8, canvases up to 64."""
    from llada_jax.bundle_runner import bundle_runner
    from lowering.bundle import compile_bundle

    bundle = compile_bundle(checkpoint, "host", tmp_path_factory.mktemp("blocks") / "b", max_len=64, window=64,
                            block_length=8)
    return json.loads((bundle / "manifest.json").read_text()), bundle_runner(bundle)[2]


@pytest.mark.slow
@settings(max_examples=12)
@given(prompt_length=st.integers(1, 30), gen_length=st.integers(1, 30),
       policy=st.sampled_from(["dual-cache", "prefix-cache", "vanilla"]), editing=st.sampled_from([None, 0.3]))
def test_a_block_bundle_holds_every_step_its_decoder_takes(model, block_bundle, prompt_length, gen_length, policy,
                                                           editing):
    """Compiled for one block length, a bundle holds one step of the layers per canvas (the block against the
    cache), no full-canvas step and no other width, and every setting of that length decodes through it as on
    XLA."""
    manifest, generate_bundled = block_bundle
    assert {(step["kind"], step["width"]) for step in manifest["steps"] if step["kind"] != "read"} == {
        ("window", 8), ("commit", 8)}
    prompt = np.arange(1, prompt_length + 1)
    options = dict(gen_length=gen_length, block_length=8, steps=4, threshold=0.3, editing_threshold=editing,
                   policy=policy, loop="host")
    assert (generate_bundled(prompt, **options).output_ids.tolist()
            == llada_jax.generate(model, prompt, **options).output_ids.tolist())


@pytest.mark.slow
def test_a_batch_decodes_each_prompt_as_alone(model):
    prompts = [np.arange(3), np.arange(1, 12), np.arange(5, 13)]
    options = dict(gen_length=10, block_length=4, steps=4, threshold=0.3, editing_threshold=0.4, policy="dual-cache")
    batch = llada_jax.generate(model, prompts, **options)
    assert [r.output_ids.tolist() for r in batch] == [
        llada_jax.generate(model, prompt, **options).output_ids.tolist() for prompt in prompts]


def test_a_streamed_stage_reads_each_expert_kind_back_to_back(checkpoint):
    """The ring plan stacks a MoE layer's experts per matrix kind, in expert order, with no gap between them (the
    step takes the stack as one `[E, ...]` tensor); every parameter is read once; the dense layer stacks nothing."""
    from llada_jax.model.params import tensor_places
    from lowering.bundle_weights import weight_layout
    from lowering.stage_ring import ring_plan

    layout = weight_layout(checkpoint, CONFIG)
    plan, places = ring_plan(layout, CONFIG), tensor_places(CONFIG)
    reads = [read for stage in plan.stages for piece in stage for read in piece.reads()]
    assert sorted(key for key, _, _, _ in reads) == sorted(p.name for p in layout.parameters if places[p.name][0] in (
        "blocks", "lm_head"))
    for layer, stage in enumerate(plan.stages[:CONFIG.n_layers]):
        stacks = [piece for piece in stage if len(piece.keys) > 1]
        assert len(stacks) == (0 if layer < CONFIG.dense_layers else 3)  # gate, up, down
        for piece in stacks:
            assert [places[key][1:] for key in piece.keys] == [
                (layer, places[piece.keys[0]][2], e) for e in range(CONFIG.n_experts)]
            starts = [offset for _, _, offset, _ in piece.reads()]
            assert starts == [piece.offset + e * piece.length // CONFIG.n_experts for e in range(CONFIG.n_experts)]


def test_a_dense_layer_width_no_group_divides_still_loads(tmp_path):
    """The memory check's 4-bit suggestion picks a group dividing every matrix's input width, the dense layers'
    too; it refused this float checkpoint ("group size 32 does not divide a matrix's 48 input columns")."""
    import dataclasses

    from llada_jax.weights.quant_config import default_group_size

    config = dataclasses.replace(CONFIG, mlp_hidden_size=32, shared_expert_size=32, dense_hidden_size=48)
    assert default_group_size(config) is None
    assert default_group_size(dataclasses.replace(config, dense_hidden_size=64)) == 32
    model = llada_jax.load(write_checkpoint(tmp_path / "dense48", config))
    assert len(llada_jax.generate(model, [1, 2, 3], gen_length=8, block_length=8, steps=8).output_ids) == 8
