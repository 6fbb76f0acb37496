"""LLaDA-8B (and LLaDA 1.5, the same architecture): `LLaDAModelLM`, OLMo-style names under `model.transformer.`.

Bidirectional llama blocks without biases, a separate LM head, no logits shift."""

from __future__ import annotations

from llada_jax.families.hf_fields import real, whole
from llada_jax.system.errors import LladaError

NAME = "llada"
ARCHITECTURE = "LLaDAModelLM"
PREFIX = "model.transformer."

# LLaDA-8B values, used only where a checkpoint's config.json leaves a field out.
MASK_ID = 126336
EOS_ID = 126081
EOT_ID = 126348

# Fields whose value must be exactly this for the architecture we implement.
REQUIRED_VALUES = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "alibi": False,
    "rope": True,
    "include_bias": False,
    "include_qkv_bias": False,
    "weight_tying": False,
    "scale_logits": False,
    "input_emb_norm": False,
    "attention_layer_norm": False,
    "layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "rope_full_precision": True,
    "clip_qkv": None,   # the reference clamps q, k and v to +-clip_qkv: any other value is refused
}
# Decoding conventions of the family's reference code: no confidence filter, blocks begun by their rule.
CONFIDENCE_TOP_K = None
FIRST_TOKEN_BLOCKS = False
# The decoder matrices `llada quantize` quantizes (a regex over HF module names).
QUANTIZED_BLOCK = r".*blocks\.\d+\.(q_proj|k_proj|v_proj|attn_out|ff_proj|up_proj|ff_out)$"
# One decoder layer's tensors: our key -> the checkpoint's short name (`blocks.{i}.{name}.weight`).
BLOCK = {"attn_norm": "attn_norm", "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
         "attn_out": "attn_out", "ff_norm": "ff_norm", "ff_proj": "ff_proj", "up_proj": "up_proj",
         "ff_out": "ff_out"}


def config_fields(raw: dict) -> dict:
    """The config fields of an HF LLaDA config.json; unsupported architecture options are errors."""
    for field, wanted in REQUIRED_VALUES.items():
        if field in raw and raw[field] is not None and raw[field] != wanted:
            raise LladaError(f"config field {field}={raw[field]!r} is not supported (need {wanted!r})")
    d_model, n_layers, n_heads = whole(raw, "d_model"), whole(raw, "n_layers"), whole(raw, "n_heads")
    vocab_size = whole(raw, "vocab_size", 0) or whole(raw, "embedding_size", 0)
    if not vocab_size:
        raise LladaError("config.json lacks both vocab_size and embedding_size")
    multi_query = raw.get("multi_query_attention")
    return dict(
        family=NAME,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=whole(raw, "n_kv_heads", 1 if multi_query else n_heads),
        mlp_hidden_size=whole(raw, "mlp_hidden_size", 0) or whole(raw, "mlp_ratio", 4) * d_model,
        vocab_size=vocab_size,
        embedding_size=whole(raw, "embedding_size", 0) or vocab_size,
        max_sequence_length=whole(raw, "max_sequence_length", 4096),
        rope_theta=real(raw, "rope_theta", 10000.0),
        rms_norm_eps=real(raw, "rms_norm_eps", 1e-5),
        mask_token_id=whole(raw, "mask_token_id", MASK_ID),
        eos_token_id=whole(raw, "eos_token_id", EOS_ID),
        eot_token_id=whole(raw, "eot_token_id", EOT_ID),
    )


def hf_config(config) -> dict:
    """The config.json that HF `LLaDAModelLM` (and our loader) reads back to `config`."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llada",
        **REQUIRED_VALUES,
        "d_model": config.d_model,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "mlp_hidden_size": config.mlp_hidden_size,
        "mlp_ratio": max(1, config.mlp_hidden_size // config.d_model),
        "vocab_size": config.vocab_size,
        "embedding_size": config.embedding_size,
        "max_sequence_length": config.max_sequence_length,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "mask_token_id": config.mask_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.eos_token_id,
    }


def tensor_names(config) -> dict[tuple, str]:
    """Every tensor's place in the params pytree -> its name in the checkpoint, in checkpoint order."""
    names: dict[tuple, str] = {("wte",): PREFIX + "wte.weight"}
    for layer in range(config.n_layers):
        for key, short in BLOCK.items():
            names[("blocks", layer, key)] = f"{PREFIX}blocks.{layer}.{short}.weight"
    names[("ln_f",)] = PREFIX + "ln_f.weight"
    names[("lm_head",)] = PREFIX + "ff_out.weight"
    return names
