"""LLaDA-MoE-7B-A1B (Base/Instruct): `LLaDAMoEModelLM`, the OLMoE layout (its config.json says
`model_type: llada` like LLaDA-8B's, so the architecture name decides).

Deltas over LLaDA: per-head RMSNorm on q and k before RoPE (`q_norm`/`k_norm`, shape [head_dim]), and every
layer a sparse MoE: a router without bias, softmax over all experts in float32, the top k kept without
renormalisation, SwiGLU experts, no shared expert. Its reference code ignores `norm_topk_prob`,
`routed_scaling_factor` and `moe_router_score_function`; so do we."""

from __future__ import annotations

from llada_jax.families.hf_fields import attention_names, flag, integers, require, shared_config, shared_fields
from llada_jax.system.errors import LladaError

NAME = "llada-moe"
ARCHITECTURE = "LLaDAMoEModelLM"
MASK_ID = 156895
CONFIDENCE_TOP_K = None  # LLaDA's `generate` decodes it
FIRST_TOKEN_BLOCKS = False
# Each expert quantized on its own; the router (`mlp.gate`) stays float: its softmax picks the experts.
QUANTIZED_BLOCK = r".*layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)$"
EXPERT_MATRICES = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}


def config_fields(raw: dict) -> dict:
    experts, per_token, hidden = integers(raw, "num_experts", "num_experts_per_tok", "expert_intermediate_size")
    if experts < 1:  # 0 would read as a dense model, whose names the checkpoint does not have
        raise LladaError(f"config field num_experts={experts}: {ARCHITECTURE} needs at least one expert")
    for field, allowed in (("attention_bias", (False,)), ("clip_qkv", (None,)), ("partial_rotary_factor", (1, 1.0)),
                           ("moe_router_enable_expert_bias", (False, None)),
                           ("shared_expert_intermediate_size", (None,)), ("qk_layernorm", (True, False))):
        require(raw, field, allowed, ARCHITECTURE)
    layers = raw.get("num_hidden_layers")
    freq = raw.get("moe_layer_freq")
    if freq is not None and (not isinstance(freq, list) or any(f != 1 for f in freq) or len(freq) != layers):
        raise LladaError(f"config field moe_layer_freq={freq!r} is not supported for {ARCHITECTURE} "
                         "(every layer a sparse MoE layer: a list of 1s, one per layer)")
    return dict(shared_fields(raw, ARCHITECTURE, MASK_ID), family=NAME, mlp_hidden_size=hidden,
                qk_norm=flag(raw, "qk_layernorm", True), n_experts=experts, experts_per_token=per_token)


def hf_config(config) -> dict:
    return dict(shared_config(config, ARCHITECTURE, "llada"), expert_intermediate_size=config.mlp_hidden_size,
                num_experts=config.n_experts, num_experts_per_tok=config.experts_per_token,
                qk_layernorm=config.qk_norm, moe_layer_freq=[1] * config.n_layers, attention_bias=False,
                clip_qkv=None, partial_rotary_factor=1, shared_expert_intermediate_size=None,
                moe_router_enable_expert_bias=False, norm_topk_prob=False)


def tensor_names(config) -> dict[tuple, str]:
    names: dict[tuple, str] = {("wte",): "model.embed_tokens.weight"}
    for layer in range(config.n_layers):
        prefix = f"model.layers.{layer}."
        block = dict(attention_names(prefix, q_norm=config.qk_norm), router=prefix + "mlp.gate.weight")
        names.update({("blocks", layer, key): name for key, name in block.items()})
        for expert in range(config.n_experts):
            for key, short in EXPERT_MATRICES.items():
                names[("blocks", layer, key, expert)] = f"{prefix}mlp.experts.{expert}.{short}.weight"
    names[("ln_f",)] = "model.norm.weight"
    names[("lm_head",)] = "lm_head.weight"
    return names
