"""The params pytree and its shape-only twin; the family (`llada_jax.families`) names every tensor as its HF
checkpoint does.

No JAX at import time (the bundle runtime uses the shapes). Matrices keep the checkpoint's torch layout
`[out_features, in_features]`, so loading is a plain copy and export back to HF is bit-exact; a sparse MoE
layer's experts are a list per matrix, one array each, as stored (`llada_jax.model.moe`). Pytree:
    {"wte": [E, D], "blocks": [{key: array} per layer], "ln_f": [D], "lm_head": [E, D]}
Block keys: attn_norm, q_proj, k_proj, v_proj (or one qkv_proj), attn_out, ff_norm, then ff_proj, up_proj, ff_out
(a dense MLP) or router, experts_gate, experts_up, experts_down (a sparse MoE; expert_bias, shared_gate,
shared_up, shared_down where it has them); q_bias, k_bias, v_bias and q_norm, k_norm where the family has them.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import numpy as np

from llada_jax import families
from llada_jax.model.config import LLaDAConfig


def block_shapes(config: LLaDAConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of a decoder layer's tensors by key (an MoE expert's matrices: one expert's); a model with dense
    and sparse layers has both kinds of keys here, each layer its own (`tensor_places`)."""
    d, hd, h = config.d_model, config.head_dim, config.mlp_hidden_size
    q, kv = config.n_heads * hd, config.n_kv_heads * hd
    shapes = {"attn_norm": (d,), "q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "qkv_proj": (q + 2 * kv, d),
              "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": (hd,), "k_norm": (hd,),
              "attn_out": (d, q), "ff_norm": (d,)}
    if config.n_experts:
        shapes.update(router=(config.n_experts, d), expert_bias=(config.n_experts,), experts_gate=(h, d),
                      experts_up=(h, d), experts_down=(d, h))
        s = config.shared_expert_size
        shapes.update(shared_gate=(s, d), shared_up=(s, d), shared_down=(d, s))
    dense = config.dense_hidden_size if config.n_experts else h
    shapes.update(ff_proj=(dense, d), up_proj=(dense, d), ff_out=(d, dense))
    return shapes


@functools.cache  # read per tensor and per module by loaders and quantization (an MoE has thousands)
def tensor_places(config: LLaDAConfig) -> MappingProxyType:
    """Every checkpoint tensor's name -> its place in the pytree: `("wte",)`, `("blocks", layer, key)`, or
    `("blocks", layer, key, expert)` for one expert of an MoE matrix. In checkpoint order; read-only."""
    return MappingProxyType({name: place for place, name in families.named(config.family).tensor_names(config).items()})


def stage_key(place: tuple) -> str:
    """A layer tensor's name in its packed stage (`llada_jax.staging.packing`): its key, or `key.expert` for one
    expert's matrix of a sparse MoE."""
    return place[2] if len(place) == 3 else f"{place[2]}.{place[3]}"


def layer_stage_shapes(config: LLaDAConfig, layer: int = 0, stacked: bool = False) -> dict[str, tuple[int, ...]]:
    """Decoder layer `layer`'s tensors by stage key, in checkpoint order (LLaDA2's dense first layers differ
    from its MoE layers; every other family's layers are alike); `stacked`: each MoE matrix kind one stack
    `[E, ...]` under its key, at its first expert's place."""
    shapes: dict[str, tuple[int, ...]] = {}
    for place in tensor_places(config).values():
        if place[0] != "blocks" or place[1] != layer:
            continue
        if stacked and len(place) == 4:
            shapes.setdefault(place[2], (config.n_experts, *_shape(config, place)))
        else:
            shapes[stage_key(place)] = _shape(config, place)
    return shapes


def block_from_stage(tensors: dict) -> dict:
    """A layer's stage tensors as a params block: each MoE matrix's `key.expert` entries regrouped into a
    list in expert order (the inverse of `stage_key`)."""
    block, experts = {}, {}
    for name, tensor in tensors.items():
        key, _, expert = name.partition(".")
        if expert:
            experts.setdefault(key, {})[int(expert)] = tensor
        else:
            block[name] = tensor
    for key, matrices in experts.items():
        block[key] = [matrices[e] for e in sorted(matrices)]
    return block


def _shape(config: LLaDAConfig, place: tuple) -> tuple[int, ...]:
    if place[0] in ("wte", "lm_head"):
        return (config.embedding_size, config.d_model)
    if place[0] == "ln_f":
        return (config.d_model,)
    return block_shapes(config)[place[2]]


def hf_shapes(config: LLaDAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint: full name -> shape. This drives init, loading and export."""
    return {name: _shape(config, place) for name, place in tensor_places(config).items()}


def tensor_role(hf_name: str, config: LLaDAConfig) -> str:
    """A checkpoint tensor's key: `q_proj` for LLaDA's `...blocks.3.q_proj.weight` or Dream's
    `model.layers.3.self_attn.q_proj.weight`, `lm_head` for the head."""
    place = tensor_places(config)[hf_name]
    return place[0] if len(place) == 1 else place[2]


def hf_to_params(tensors: dict[str, object], config: LLaDAConfig, stacks: dict | None = None) -> dict:
    """Arrange tensors keyed by HF name into the params pytree (no copies); `stacks`: (layer, key) -> an MoE
    matrix kind's experts as one stack `[E, ...]`, whose experts are absent from `tensors`."""
    params: dict = {"blocks": [{} for _ in range(config.n_layers)]}
    listed: dict[tuple[int, str], list] = {}
    for name, place in tensor_places(config).items():
        if len(place) == 1:
            params[place[0]] = tensors[name]
        elif len(place) == 3:
            params["blocks"][place[1]][place[2]] = tensors[name]
        elif name in tensors:
            listed.setdefault(place[1:3], []).append(tensors[name])
    for (layer, key), matrices in {**listed, **(stacks or {})}.items():
        params["blocks"][layer][key] = matrices
    return {"wte": params["wte"], "blocks": params["blocks"], "ln_f": params["ln_f"], "lm_head": params["lm_head"]}


def params_to_hf(params: dict, config: LLaDAConfig) -> dict[str, object]:
    """The inverse of `hf_to_params`: HF name -> tensor, in checkpoint order."""
    tensors = {}
    for name, place in tensor_places(config).items():
        node = params
        for step in place:
            node = node[step]
        tensors[name] = node
    return tensors


def init_params(config: LLaDAConfig, seed: int = 0, dtype="float32", std: float = 0.02) -> dict:
    """Random weights: N(0, std) matrices and biases, unit norm gains (a test or training starting point)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes(config).items():
        if name.endswith("expert_bias"):
            value = rng.normal(0.0, std, size=shape).astype(np.float32)
        elif len(shape) == 1 and not name.endswith(".bias"):
            value = np.ones(shape, np.float32)
        else:
            value = rng.normal(0.0, std, size=shape).astype(np.float32)
        tensors[name] = jnp.asarray(value, dtype=dtype)
    return hf_to_params(tensors, config)
