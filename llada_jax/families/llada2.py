"""LLaDA2.0 / LLaDA2.1 (mini, flash): `LLaDA2MoeModelLM`, inclusionAI's block-diffusion MoE (`model_type:
llada2_moe`), as the dllm library's `pipelines/llada2` and `pipelines/llada21` modeling code computes it.

Deltas over LLaDA: one fused `attention.query_key_value` projection (q heads, then k, then v rows), output
`attention.dense`; per-head q/k RMSNorm (one gain over head_dim) before RoPE; partial rotary (the first
`head_dim * partial_rotary_factor` dims, rotate-half within them); the first `first_k_dense_replace` layers a
dense SwiGLU, the rest a sparse MoE routed by a float32 sigmoid with group-limited top-k on score +
`expert_bias` (a group scores the sum of its top 2; `topk_group` groups kept), the chosen experts weighted by
their unbiased scores normalised to sum 1, times `routed_scaling_factor`, plus an unweighted shared expert.
Attention is block-causal (a block sees itself and earlier blocks): its decoders are block diffusion
(`policies.block_diffusion`)."""

from __future__ import annotations

from llada_jax.families.hf_fields import end_of_text, flag, integers, real, require, whole
from llada_jax.system.errors import LladaError

NAME = "llada2"
ARCHITECTURE = "LLaDA2MoeModelLM"
MASK_ID = 156895  # `<|mask|>`, the reference `generate`'s mask_id default
EOS_ID = 156892   # its eos_id default (also the configs' pad_token_id)
CONFIDENCE_TOP_K = None
FIRST_TOKEN_BLOCKS = False
# Each expert and the shared expert quantized on their own; the router (`mlp.gate`) stays float.
QUANTIZED_BLOCK = (r".*layers\.\d+\.(attention\.(query_key_value|dense)|"
                   r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)$")
EXPERT_MATRICES = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}
SHARED_MATRICES = {"shared_gate": "gate_proj", "shared_up": "up_proj", "shared_down": "down_proj"}
DENSE_MATRICES = {"ff_proj": "gate_proj", "up_proj": "up_proj", "ff_out": "down_proj"}

# Fields the reference modeling code reads whose other values change the architecture beyond what we implement.
# (`norm_topk_prob`, `score_function`, `router_dtype`, `rotary_dim`, `moe_router_enable_expert_bias` are
# stored in the configs but never read by it: the router is always a float32 sigmoid, renormalised.)
REQUIRED = (("hidden_act", ("silu",)), ("rope_scaling", (None,)), ("tie_word_embeddings", (False,)),
            ("use_qkv_bias", (False,)), ("use_bias", (False,)), ("norm_head", (False,)),
            ("use_sliding_window", (False, None)))


def config_fields(raw: dict) -> dict:
    d_model, n_layers, n_heads, vocab, experts, per_token = integers(
        raw, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts",
        "num_experts_per_tok")
    for field, allowed in REQUIRED:
        if field == "use_bias" and field not in raw:
            raise LladaError("config.json lacks use_bias (the reference defaults it to true: a bias on "
                             "attention.dense, which LLaDA2 checkpoints do not have)")
        require(raw, field, allowed, ARCHITECTURE)
    head_dim = whole(raw, "head_dim", 0) or d_model // n_heads
    if head_dim * n_heads != d_model:
        raise LladaError(f"config head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={d_model}; "
                         f"{ARCHITECTURE} with a separate head width is not supported")
    rotary_dim = int(head_dim * real(raw, "partial_rotary_factor", 0.5))
    if rotary_dim <= 0 or rotary_dim % 2:
        raise LladaError(f"config partial_rotary_factor gives {rotary_dim} rotary dims; need an even number > 0")
    dense_layers = whole(raw, "first_k_dense_replace", 0)
    (moe_hidden,) = integers(raw, "moe_intermediate_size")
    dense_hidden = integers(raw, "intermediate_size")[0] if dense_layers else 0
    groups, kept = whole(raw, "n_group", 8), whole(raw, "topk_group", 4)
    if groups < 1 or experts % groups or not 1 <= kept <= groups or per_token > kept * experts // groups:
        raise LladaError(f"config n_group={groups}, topk_group={kept} do not fit num_experts={experts} and "
                         f"num_experts_per_tok={per_token}")
    if experts // groups < 2:
        raise LladaError(f"config n_group={groups} leaves fewer than 2 experts per group (a group scores its top 2)")
    if not 0 <= dense_layers <= n_layers:
        raise LladaError(f"config first_k_dense_replace={dense_layers} is outside [0, {n_layers}]")
    eos = end_of_text(raw, EOS_ID)
    return dict(
        family=NAME, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=whole(raw, "num_key_value_heads", n_heads), vocab_size=vocab, embedding_size=vocab,
        max_sequence_length=whole(raw, "max_position_embeddings", 16384),
        rope_theta=real(raw, "rope_theta", 10000.0), rms_norm_eps=real(raw, "rms_norm_eps", 1e-5),
        mask_token_id=whole(raw, "mask_token_id", MASK_ID), eos_token_id=eos,
        eot_token_id=whole(raw, "eot_token_id", eos), qk_norm=flag(raw, "use_qk_norm", True),
        rotary_dim=rotary_dim, mlp_hidden_size=moe_hidden, n_experts=experts,
        experts_per_token=per_token, dense_layers=dense_layers, dense_hidden_size=dense_hidden,
        shared_expert_size=moe_hidden * whole(raw, "num_shared_experts", 0),
        router="sigmoid-grouped", expert_groups=groups, groups_kept=kept,
        routed_scaling=real(raw, "routed_scaling_factor", 2.5), block_causal=True)


def hf_config(config) -> dict:
    return {
        "architectures": [ARCHITECTURE], "model_type": "llada2_moe", "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim, "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_sequence_length, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu", "rope_scaling": None,
        "tie_word_embeddings": False, "use_qkv_bias": False, "use_bias": False, "norm_head": False,
        "use_qk_norm": config.qk_norm, "partial_rotary_factor": config.rotary_dim / config.head_dim,
        "first_k_dense_replace": config.dense_layers, "intermediate_size": config.dense_hidden_size or None,
        "moe_intermediate_size": config.mlp_hidden_size, "num_experts": config.n_experts,
        "num_experts_per_tok": config.experts_per_token,
        "num_shared_experts": config.shared_expert_size // config.mlp_hidden_size or None,
        "n_group": config.expert_groups, "topk_group": config.groups_kept,
        "routed_scaling_factor": config.routed_scaling, "mask_token_id": config.mask_token_id,
        "eos_token_id": config.eos_token_id, "pad_token_id": config.eos_token_id, "use_sliding_window": False,
    }


def tensor_names(config) -> dict[tuple, str]:
    names: dict[tuple, str] = {("wte",): "model.word_embeddings.weight"}
    for layer in range(config.n_layers):
        prefix = f"model.layers.{layer}."
        block = {"attn_norm": "input_layernorm.weight", "qkv_proj": "attention.query_key_value.weight"}
        if config.qk_norm:
            block.update(q_norm="attention.query_layernorm.weight", k_norm="attention.key_layernorm.weight")
        block.update(attn_out="attention.dense.weight", ff_norm="post_attention_layernorm.weight")
        if layer < config.dense_layers:
            block.update({key: f"mlp.{short}.weight" for key, short in DENSE_MATRICES.items()})
        else:
            block.update(router="mlp.gate.weight", expert_bias="mlp.gate.expert_bias")
        names.update({("blocks", layer, key): prefix + name for key, name in block.items()})
        if layer < config.dense_layers:
            continue
        for expert in range(config.n_experts):
            for key, short in EXPERT_MATRICES.items():
                names[("blocks", layer, key, expert)] = f"{prefix}mlp.experts.{expert}.{short}.weight"
        if config.shared_expert_size:
            names.update({("blocks", layer, key): f"{prefix}mlp.shared_experts.{short}.weight"
                          for key, short in SHARED_MATRICES.items()})
    names[("ln_f",)] = "model.norm.weight"
    names[("lm_head",)] = "lm_head.weight"
    return names
