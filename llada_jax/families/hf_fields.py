"""Reading the transformers-style config.json fields the Qwen2-like families share (Dream, LLaDA-MoE)."""

from __future__ import annotations

from llada_jax.system.errors import LladaError


def integers(raw: dict, *names: str) -> list[int]:
    """The named integer fields, each required (one-line errors)."""
    values = []
    for name in names:
        if name not in raw or raw[name] is None:
            raise LladaError(f"config.json lacks required field {name}")
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise LladaError(f"config.json field {name} must be an integer, got {value!r}")
        values.append(value)
    return values


def require(raw: dict, field: str, allowed: tuple, architecture: str) -> None:
    """A field whose value changes the architecture: only `allowed` values (absent counts as the first) load."""
    value = raw.get(field, allowed[0])
    if value not in allowed:
        raise LladaError(f"config field {field}={value!r} is not supported for {architecture} "
                         f"(need {' or '.join(repr(a) for a in allowed)})")


def shared_fields(raw: dict, architecture: str, mask_id: int) -> dict:
    """The fields Dream and LLaDA-MoE read alike: sizes, RoPE, norms, special ids."""
    d_model, n_layers, n_heads, vocab = integers(raw, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "vocab_size")
    for field, allowed in (("hidden_act", ("silu",)), ("rope_scaling", (None,)), ("tie_word_embeddings", (False,)),
                           ("use_sliding_window", (False,))):
        require(raw, field, allowed, architecture)
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):  # transformers allows several; the first ends an answer
        eos = eos[0] if eos else None
    if not isinstance(eos, int):
        raise LladaError(f"config.json field eos_token_id must be a token id, got {eos!r}")
    return dict(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        vocab_size=vocab,
        embedding_size=vocab,
        max_sequence_length=int(raw.get("max_position_embeddings", 4096)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        mask_token_id=int(raw.get("mask_token_id", mask_id)),
        eos_token_id=eos,
        eot_token_id=int(raw.get("eot_token_id", eos)),
    )


def shared_config(config, architecture: str, model_type: str) -> dict:
    """The config.json fields `shared_fields` reads back to `config`."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_sequence_length,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "mask_token_id": config.mask_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.eos_token_id,
    }


def attention_names(prefix: str, q_norm: bool = False, bias: bool = False) -> dict[str, str]:
    """A Qwen2/OLMoE-style layer's attention tensors: our key -> name under `model.layers.{i}.`."""
    names = {"attn_norm": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight",
             "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight"}
    if bias:
        names.update(q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias", v_bias="self_attn.v_proj.bias")
    if q_norm:
        names.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    names.update(attn_out="self_attn.o_proj.weight", ff_norm="post_attention_layernorm.weight")
    return {key: prefix + name for key, name in names.items()}
