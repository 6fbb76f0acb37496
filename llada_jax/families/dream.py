"""Dream-v0-7B (Base/Instruct; Dream-Coder and DiffuCoder share it): `DreamModel`, the Qwen2.5 layout.

Deltas over LLaDA: biases on the q/k/v projections (not on o_proj), and shifted logits: position i is
predicted by row i-1 of the computed positions (the first row predicts itself), as Dream's
`diffusion_generate` and Fast-dLLM's Dream decoder shift them."""

from __future__ import annotations

from llada_jax.families.hf_fields import attention_names, integers, shared_config, shared_fields

NAME = "dream"
ARCHITECTURE = "DreamModel"
MASK_ID = 151666
# Dream's decoders (its `diffusion_generate`, Fast-dLLM's Dream decoder) under transformers 4.x filter their
# confidences to the top 50 logits unless called with top_k=None: the model config carries transformers' default
# top_k=50 into their generation config. Fast-dLLM's Dream decoder begins each cached block by committing its
# first position alone.
CONFIDENCE_TOP_K = 50
FIRST_TOKEN_BLOCKS = True
QUANTIZED_BLOCK = r".*layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$"


def config_fields(raw: dict) -> dict:
    shared = shared_fields(raw, ARCHITECTURE, MASK_ID)
    (mlp_hidden,) = integers(raw, "intermediate_size")
    return dict(shared, family=NAME, mlp_hidden_size=mlp_hidden, qkv_bias=True, logits_shift=True)


def hf_config(config) -> dict:
    return dict(shared_config(config, ARCHITECTURE, "Dream"), intermediate_size=config.mlp_hidden_size,
                use_sliding_window=False)


def tensor_names(config) -> dict[tuple, str]:
    names: dict[tuple, str] = {("wte",): "model.embed_tokens.weight"}
    for layer in range(config.n_layers):
        prefix = f"model.layers.{layer}."
        block = dict(attention_names(prefix, bias=True), ff_proj=prefix + "mlp.gate_proj.weight",
                     up_proj=prefix + "mlp.up_proj.weight", ff_out=prefix + "mlp.down_proj.weight")
        names.update({("blocks", layer, key): name for key, name in block.items()})
    names[("ln_f",)] = "model.norm.weight"
    names[("lm_head",)] = "lm_head.weight"
    return names
