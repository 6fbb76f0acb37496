"""The params pytree and its shape-only twin, named exactly as the HF LLaDA checkpoint names tensors.

No JAX at import time (the bundle runtime uses the shapes). Matrices keep the checkpoint's torch layout
`[out_features, in_features]`, so loading is a plain copy and export back to HF is bit-exact. Pytree:
    {"wte": [E, D], "blocks": [{name: array} per layer], "ln_f": [D], "lm_head": [E, D]}
"""

from __future__ import annotations

import numpy as np

from llada_jax.config import LLaDAConfig

HF_PREFIX = "model.transformer."
BLOCK_TENSORS = ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")
_TOP_LEVEL = {"wte": "wte.weight", "ln_f": "ln_f.weight", "lm_head": "ff_out.weight"}


def block_shapes(config: LLaDAConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's tensors, keyed by their HF short name."""
    d, kv, h = config.d_model, config.n_kv_heads * config.head_dim, config.mlp_hidden_size
    return {
        "attn_norm": (d,),
        "q_proj": (d, d),
        "k_proj": (kv, d),
        "v_proj": (kv, d),
        "attn_out": (d, d),
        "ff_norm": (d,),
        "ff_proj": (h, d),
        "up_proj": (h, d),
        "ff_out": (d, h),
    }


def hf_shapes(config: LLaDAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint: full name -> shape. This drives init, loading and export."""
    e, d = config.embedding_size, config.d_model
    shapes = {HF_PREFIX + "wte.weight": (e, d)}
    for layer in range(config.n_layers):
        for name, shape in block_shapes(config).items():
            shapes[f"{HF_PREFIX}blocks.{layer}.{name}.weight"] = shape
    shapes[HF_PREFIX + "ln_f.weight"] = (d,)
    shapes[HF_PREFIX + "ff_out.weight"] = (e, d)
    return shapes


def tensor_role(hf_name: str) -> str:
    """A checkpoint tensor's short name: `q_proj` for `...blocks.3.q_proj.weight`, `lm_head` for the top-level
    `ff_out.weight` (not the blocks' `ff_out`)."""
    for short, full in _TOP_LEVEL.items():
        if hf_name == HF_PREFIX + full:
            return short
    return hf_name.removesuffix(".weight").rsplit(".", 1)[-1]


def hf_to_params(tensors: dict[str, object], config: LLaDAConfig) -> dict:
    """Arrange tensors keyed by HF name into the params pytree (no copies)."""
    def get(name):
        return tensors[HF_PREFIX + name]

    return {
        "wte": get(_TOP_LEVEL["wte"]),
        "blocks": [
            {name: get(f"blocks.{layer}.{name}.weight") for name in BLOCK_TENSORS}
            for layer in range(config.n_layers)
        ],
        "ln_f": get(_TOP_LEVEL["ln_f"]),
        "lm_head": get(_TOP_LEVEL["lm_head"]),
    }


def params_to_hf(params: dict) -> dict[str, object]:
    """The inverse of `hf_to_params`: HF name -> tensor, in checkpoint order."""
    tensors = {HF_PREFIX + _TOP_LEVEL["wte"]: params["wte"]}
    for layer, block in enumerate(params["blocks"]):
        for name in BLOCK_TENSORS:
            tensors[f"{HF_PREFIX}blocks.{layer}.{name}.weight"] = block[name]
    tensors[HF_PREFIX + _TOP_LEVEL["ln_f"]] = params["ln_f"]
    tensors[HF_PREFIX + _TOP_LEVEL["lm_head"]] = params["lm_head"]
    return tensors


def init_params(config: LLaDAConfig, seed: int = 0, dtype="float32", std: float = 0.02) -> dict:
    """Random weights: N(0, std) matrices, unit norm gains (a test or training starting point)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes(config).items():
        if len(shape) == 1:
            value = np.ones(shape, np.float32)
        else:
            value = rng.normal(0.0, std, size=shape).astype(np.float32)
        tensors[name] = jnp.asarray(value, dtype=dtype)
    return hf_to_params(tensors, config)
