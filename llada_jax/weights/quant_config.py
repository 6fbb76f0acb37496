"""The `quantization_config` of a compressed-tensors checkpoint (no JAX): which modules are quantized
and how, written by `llada quantize` and read back by the loader.

Module names are the HF ones, as each family spells them (LLaDA: `model.transformer.blocks.0.q_proj`, the LM
head `model.transformer.ff_out`, the embedding `model.transformer.wte`); the decoder matrices a family quantizes
are its `QUANTIZED_BLOCK` pattern (an MoE router stays float); a quantized module stores
`<module>.weight_packed` (int32), `<module>.weight_scale` (`[O, G]`) and `<module>.weight_shape`
(int64 `[2]`) instead of `<module>.weight`.
"""

from __future__ import annotations

import re

from llada_jax import families
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import hf_shapes, tensor_places
from llada_jax.quant.quantize import GROUP_SIZES, QuantScheme
from llada_jax.system.errors import LladaError

FORMAT = "pack-quantized"
# The embedding (a row gather) keeps 8 bits whatever the layers use, and so does the LM head unless asked
# (`llada quantize --head-bits 4`): together about a fifth of an int4 LLaDA-8B's bytes, where errors reach
# every position (embedding) or every score (head).
EDGE_SCHEME = QuantScheme(bits=8)


def module_of(config: LLaDAConfig, place: tuple) -> str:
    """The HF module name of the tensor at `place` in the params pytree (`("lm_head",)`: the LM head)."""
    return next(name for name, at in tensor_places(config).items() if at == place)[: -len(".weight")]


def block_target(config: LLaDAConfig) -> str:
    return "re:" + families.named(config.family).QUANTIZED_BLOCK


def _weights_args(scheme: QuantScheme) -> dict:
    return {"num_bits": scheme.bits, "type": "int", "symmetric": True, "dynamic": False,
            "strategy": "channel" if scheme.group_size is None else "group", "group_size": scheme.group_size,
            "observer": "minmax"}


def quantization_config(config: LLaDAConfig, scheme: QuantScheme, head: QuantScheme = EDGE_SCHEME) -> dict:
    """The config.json entry for decoder layers quantized with `scheme`, the embedding at 8 bits and the
    LM head with `head`."""
    def group(targets, weights):
        return {"targets": targets, "weights": _weights_args(weights), "input_activations": None,
                "output_activations": None, "format": FORMAT}

    head_module, embedding = module_of(config, ("lm_head",)), module_of(config, ("wte",))
    groups = {"group_0": group([block_target(config)], scheme)}
    if head == EDGE_SCHEME:
        groups["group_1"] = group([head_module, embedding], EDGE_SCHEME)
    else:
        groups["group_1"], groups["group_2"] = group([embedding], EDGE_SCHEME), group([head_module], head)
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": groups, "ignore": [], "kv_cache_scheme": None}


def quantized_modules(hf_config: dict, config: LLaDAConfig) -> dict[str, QuantScheme]:
    """Module name -> scheme from a config.json dict ({} when it has no quantization_config)."""
    spec = hf_config.get("quantization_config")
    if spec is None:
        return {}
    where = "config.json quantization_config"
    if not isinstance(spec, dict) or spec.get("quant_method") != "compressed-tensors":
        raise LladaError(f"{where}: only compressed-tensors checkpoints are supported")
    if spec.get("format", FORMAT) != FORMAT:
        raise LladaError(f"{where}: format {spec.get('format')!r} is not supported (only {FORMAT})")
    modules = _matrices(config)
    ignored, groups = spec.get("ignore") or [], spec.get("config_groups") or {}
    if not isinstance(groups, dict) or not _strings(ignored):
        raise LladaError(f"{where}: config_groups must be an object of groups and ignore a list of module names")
    schemes = {}
    for group_name, group in groups.items():
        scheme = _group_scheme(group, f"{where} group {group_name}")
        targets = [_target(target, f"{where} group {group_name}") for target in group.get("targets", [])]
        for module in modules:
            if module not in ignored and any(_matches(t, module, config) for t in targets):
                schemes[module] = scheme
    return schemes


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _target(target, where: str):
    """A module name, "Linear", or `re:PATTERN` compiled (a bad pattern is the checkpoint's error)."""
    if not isinstance(target, str):
        raise LladaError(f"{where}: a target must be a module name or 're:PATTERN', got {target!r}")
    if not target.startswith("re:"):
        return target
    try:
        return re.compile(target[3:])
    except re.error as err:
        raise LladaError(f"{where}: target {target!r} is not a valid pattern ({err})") from None


def _group_scheme(group, where: str) -> QuantScheme:
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise LladaError(f"{where}: needs a 'weights' object")
    if not isinstance(group.get("targets", []), list):
        raise LladaError(f"{where}: targets must be a list")
    if group.get("input_activations") or group.get("output_activations"):
        raise LladaError(f"{where}: stored activation quantization is not supported (weights only)")
    args = group["weights"]
    if args.get("type", "int") != "int" or not args.get("symmetric", True):
        raise LladaError(f"{where}: only symmetric integer weights are supported")
    strategy = args.get("strategy")
    if strategy not in ("channel", "group"):
        raise LladaError(f"{where}: weight strategy {strategy!r} is not supported (channel or group)")
    return QuantScheme(args.get("num_bits"), args.get("group_size") if strategy == "group" else None)


def _matches(target: str | re.Pattern, module: str, config: LLaDAConfig) -> bool:
    if isinstance(target, re.Pattern):
        return target.match(module) is not None
    return target in (module, "Linear") and (target != "Linear" or module != module_of(config, ("wte",)))


def planned_modules(config: LLaDAConfig, scheme: QuantScheme,
                    head: QuantScheme = EDGE_SCHEME) -> dict[str, QuantScheme]:
    """Module -> scheme that `llada quantize` with `scheme` (and `head`) would write."""
    head_module, embedding = module_of(config, ("lm_head",)), module_of(config, ("wte",))
    blocks = re.compile(families.named(config.family).QUANTIZED_BLOCK)
    planned = {module: scheme for module in _matrices(config) if blocks.match(module)}
    return dict(planned, **{head_module: head, embedding: EDGE_SCHEME})


def _matrices(config: LLaDAConfig) -> list[str]:
    return [name[: -len(".weight")] for name, shape in hf_shapes(config).items() if len(shape) == 2]


def default_group_size(config: LLaDAConfig) -> int | None:
    """The largest of GROUP_SIZES dividing every matrix's input width (None if none does)."""
    widths = {shape[-1] for shape in hf_shapes(config).values() if len(shape) == 2}
    return next((g for g in sorted(GROUP_SIZES, reverse=True) if all(w % g == 0 for w in widths)), None)
