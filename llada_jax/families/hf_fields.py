"""Reading config.json fields: typed values for every family (an integer is an integer, not `"128"`, `true`
or `128.9`; a number is finite), and the transformers-style fields the Qwen2-like families share (Dream,
LLaDA-MoE)."""

from __future__ import annotations

import math

from llada_jax.system.errors import LladaError


def whole(raw: dict, name: str, default: int | None = None) -> int:
    """Integer field `name` (a float with no fraction counts); absent or null: `default`, or an error without one."""
    value = raw.get(name)
    if value is None:
        if default is None:
            raise LladaError(f"config.json lacks required field {name}")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise LladaError(f"config.json field {name} must be an integer, got {value!r}")
    return value


def real(raw: dict, name: str, default: float) -> float:
    """Finite number field `name`; absent or null: `default`."""
    value = raw.get(name)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LladaError(f"config.json field {name} must be a finite number, got {value!r}")
    return float(value)


def flag(raw: dict, name: str, default: bool) -> bool:
    """Boolean field `name`; absent or null: `default`."""
    value = raw.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LladaError(f"config.json field {name} must be true or false, got {value!r}")
    return value


def integers(raw: dict, *names: str) -> list[int]:
    """The named integer fields, each required (one-line errors)."""
    return [whole(raw, name) for name in names]


def end_of_text(raw: dict, default: int | None) -> int:
    """`eos_token_id`: transformers allows a list, whose first ends an answer."""
    eos = raw.get("eos_token_id", default)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return whole({"eos_token_id": eos}, "eos_token_id")


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
    eos = end_of_text(raw, None)
    return dict(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=whole(raw, "num_key_value_heads", n_heads),
        vocab_size=vocab,
        embedding_size=vocab,
        max_sequence_length=whole(raw, "max_position_embeddings", 4096),
        rope_theta=real(raw, "rope_theta", 10000.0),
        rms_norm_eps=real(raw, "rms_norm_eps", 1e-6),
        mask_token_id=whole(raw, "mask_token_id", mask_id),
        eos_token_id=eos,
        eot_token_id=whole(raw, "eot_token_id", eos),
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
