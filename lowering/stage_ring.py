"""Weights streamed by the IREE program itself: a bundle whose weights exceed its device memory budget reads
each stage (a decoder layer's tensors, or a slice of the LM head's rows, or under the smallest budgets of the
embedding's) from the weights file into a ring of two device buffers,
the next stage while one computes, so `iree-run-module` (and `run.sh`) runs it with no host code of ours.

The steps are exported with a `llada_stage` custom call where each stage is needed (`llada_jax.model.staged`);
`rewrite_stage_calls` replaces each call with a call to a function that:
1. signals a fence when the activations entering the stage are computed (`hal.tensor.barrier`): the stage before
   has then finished with its slot;
2. reads the stage into the slot the stage before did not use, after that fence and the previous read, unless the
   call before already did (a chain: see 4);
3. hands the stage's tensors to the step as `hal.tensor.import`s of the slot, waiting for its read;
4. if the next call follows in the same region (the next layer of the same forward), reads that call's stage into
   the other slot, after the fence of 1: that read overlaps this stage's compute.
A chain's first call reads its own stage, so the order of calls across regions (a loop's passes, a step's
branches) never matters; what it assumes is that the activations entering a call depend on everything the
stages before it computed from the ring, as a forward's do.
The weights file is the one the bundle binds to scope "model"; nothing is read at load but the resident tensors.
"""

from __future__ import annotations

import dataclasses
import math
import re

from llada_jax.model.params import tensor_places
from llada_jax.model.staged import TARGET
from lowering.bundle_format import PARAMETER_SCOPE
from lowering.bundle_weights import Parameter, WeightLayout, expert_stack
from lowering.kernel_dispatch import ROWS_PER_WORKGROUP

ALIGNMENT = 256  # bytes between a slot's tensors
SLOTS = 2
ITEM_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}
CALL = re.compile(
    rf"^(?P<indent>\s*)(?P<result>%[\w#]+):(?P<count>\d+) = stablehlo\.custom_call @{TARGET}"
    r"\((?P<operands>[^)]*)\) \{(?P<attributes>.*)\} : \((?P<types>[^)]*)\) -> \((?P<result_types>[^)]*)\)$",
    re.MULTILINE)
STAGE_INDEX = re.compile(r"stage = (\d+) : i64")
REGION_EDGE = re.compile(r"\{[ \t]*$|^[ \t]*\}", re.MULTILINE)  # a region opens (`{`, `({`) or closes
FUNCTION = re.compile(r"^\s*func\.func (?:private |public )?@([\w$.-]+)\(", re.MULTILINE)
FUNCTION_CALL = re.compile(r"\bcall @([\w$.-]+)\(")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor the step takes from a slot: one parameter, or a sparse MoE matrix kind's experts read back to
    back, which the step takes as one stack `[E, ...]` (`llada_jax.model.moe.stacked_experts`)."""

    keys: tuple[str, ...]  # the parameters' names in the weights file, in the slot's order
    offset: int            # bytes into the slot
    length: int            # bytes, all of them
    start: int = 0         # bytes into each parameter where its read begins (a chunk's first row)

    def reads(self) -> list[tuple[str, int, int, int]]:
        """(key, start in the parameter, offset in the slot, length) of each parameter's read."""
        each = self.length // len(self.keys)
        return [(key, self.start, self.offset + i * each, each) for i, key in enumerate(self.keys)]


@dataclasses.dataclass(frozen=True)
class RingPlan:
    stages: tuple[tuple[Piece, ...], ...]  # per stage: its tensors, in the order the step takes them
    # (first row, rows) of each stage from n_layers on: chunks of the LM head's rows, then of the embedding's
    chunks: tuple[tuple[int, int], ...] = ()
    head: range = range(0)       # the LM head's stages
    embedding: range = range(0)  # the embedding's stages (none: it is resident)

    @property
    def slot_bytes(self) -> int:
        return max(s[-1].offset + s[-1].length for s in self.stages)

    @property
    def ring_bytes(self) -> int:
        return SLOTS * self.slot_bytes


def group_of(parameter: Parameter, layout: WeightLayout, config) -> int | str | None:
    """What a parameter streams with: its layer's index, "lm_head", or "wte" where the layout streams the
    embedding (both in chunks of rows); None: it stays resident."""
    places = tensor_places(config)
    name = parameter.name if parameter.name in places else parameter.name.rsplit(".", 1)[0] + ".weight"
    place = places[name]
    if place[0] == "blocks":
        return place[1]
    return place[0] if place[0] == "lm_head" or (place[0] == "wte" and layout.streams_embedding) else None


def byte_size(parameter: Parameter) -> int:
    return int(math.prod(parameter.shape) * ITEM_BYTES[parameter.dtype])


def ring_plan(layout: WeightLayout, config) -> RingPlan:
    """Each stage's pieces laid out in a slot, in the layout's order (the order the steps take them); an MoE
    matrix kind's experts are one piece, at its first expert's place. The LM head (and a streamed embedding) is
    cut into chunks of rows no larger than the largest layer: the largest stage sets both slots' size."""
    grouped: dict = {}  # group (`group_of`) -> piece -> its parameters
    for parameter in layout.parameters:
        group = group_of(parameter, layout, config)
        if group is not None:
            grouped.setdefault(group, {}).setdefault(_piece_of(parameter, config), []).append(parameter)
    layers = [_laid([(tuple(p.name for p in parameters), 0, sum(map(byte_size, parameters)))
                     for parameters in grouped[layer].values()]) for layer in range(config.n_layers)]
    layer_bytes = max((s[-1].offset + s[-1].length for s in layers if s), default=0)
    head, embedding = (_row_chunks([ps[0] for ps in grouped.get(part, {}).values()], layer_bytes)
                       for part in ("lm_head", "wte"))
    chunks, first_embedding = head + embedding, config.n_layers + len(head)
    return RingPlan(tuple(layers + [stage for stage, _ in chunks]), tuple(rows for _, rows in chunks),
                    range(config.n_layers, first_embedding), range(first_embedding, first_embedding + len(embedding)))


def _row_chunks(matrices: list[Parameter], layer_bytes: int) -> list[tuple[tuple[Piece, ...], tuple[int, int]]]:
    """Matrices of as many rows each (the head's tensors, or the embedding's) in chunks of rows: each chunk's
    pieces and its (first row, rows)."""
    if not matrices:
        return []
    total, step = matrices[0].shape[0], _chunk_rows(matrices, layer_bytes)
    return [(_laid([((p.name,), first * _row_bytes(p), rows * _row_bytes(p)) for p in matrices]), (first, rows))
            for first in range(0, total, step) for rows in [min(step, total - first)]]


def _chunk_rows(matrices: list[Parameter], layer_bytes: int) -> int:
    """Rows per chunk: as few chunks as keep each within `layer_bytes`, whole workgroups of our kernels."""
    total = matrices[0].shape[0]
    chunks = max(1, -(-sum(map(byte_size, matrices)) // max(layer_bytes, 1)))
    return min(total, -(-total // chunks // ROWS_PER_WORKGROUP) * ROWS_PER_WORKGROUP)


def _row_bytes(parameter: Parameter) -> int:
    return byte_size(parameter) // parameter.shape[0]


def _laid(pieces: list[tuple[tuple[str, ...], int, int]]) -> tuple[Piece, ...]:
    """(keys, start, length) pieces laid out back to back in a slot, each at an ALIGNMENT boundary."""
    laid: list[Piece] = []
    for keys, start, length in pieces:
        offset = -(-(laid[-1].offset + laid[-1].length) // ALIGNMENT) * ALIGNMENT if laid else 0
        laid.append(Piece(keys, offset, length, start))
    return tuple(laid)


def _piece_of(parameter: Parameter, config) -> str:
    """What a parameter is stacked with: an MoE expert's tensor with the same tensor of the layer's other experts
    (`expert_stack`); anything else, nothing."""
    return expert_stack(parameter.name, config) or parameter.name


def resident_bytes(layout: WeightLayout, config) -> int:
    """Bytes of the weights that stay resident (the final norm, and the embedding unless it streams)."""
    return sum(byte_size(p) for p in layout.parameters if group_of(p, layout, config) is None)


def rewrite_stage_calls(module_text: str, plan: RingPlan, prefix: str) -> tuple[str, list[str]]:
    """`module_text` with each `llada_stage` call replaced by a call to its fetch function (named `prefix` +
    `fetch_<n>`); those functions. A call followed by another in the same region, with no region between them,
    reads that next call's stage while its own computes (`_chains`)."""
    matches = list(CALL.finditer(module_text))
    follows = _chains(module_text, matches)
    functions: list[str] = []
    calls = []
    for n, match in enumerate(matches):
        name = f"{prefix}fetch_{n}"
        types = [t.strip() for t in match["types"].split(",")]
        following = _stage(matches[n + 1]) if follows[n] else None
        functions.append(_fetch_function(name, _stage(match), types, plan, n > 0 and follows[n - 1], following))
        x = match["operands"].split(",")[0].strip()
        calls.append(f"{match['indent']}{match['result']}:{match['count']} = util.call @{name}({x}) : ({types[0]}) "
                     f"-> ({match['result_types']})")
    replacements = iter(calls)
    return CALL.sub(lambda _: next(replacements), module_text), functions


def _stage(match: re.Match) -> int:
    return int(STAGE_INDEX.search(match["attributes"])[1])  # type: ignore[index]


def _chains(module_text: str, matches: list[re.Match]) -> list[bool]:
    """Per call: whether the next call runs right after it, as the next stage to need the ring: both in one
    region (a function's body, a loop's), no region opened or closed between them, and no call between them to a
    function that reads stages itself."""
    readers = _stage_readers(module_text)

    def adjacent(a: re.Match, b: re.Match) -> bool:
        between = module_text[a.end():b.start()]
        return REGION_EDGE.search(between) is None and not readers & set(FUNCTION_CALL.findall(between))
    return [adjacent(a, b) for a, b in zip(matches, matches[1:])] + [False]


def _stage_readers(module_text: str) -> set[str]:
    """The functions whose bodies call for stages, directly or through the functions they call."""
    starts = [(m.start(), m[1]) for m in FUNCTION.finditer(module_text)]
    spans = {name: module_text[start:end] for (start, name), (end, _) in zip(starts, [*starts[1:], (None, "")])}
    readers = {name for name, body in spans.items() if CALL.search(body)}
    while grown := {name for name, body in spans.items() if readers & set(FUNCTION_CALL.findall(body))} - readers:
        readers |= grown
    return readers


def ring_parts(plan: RingPlan) -> list[str]:
    """The ring's globals, their initializer (the slots allocated, no stage pending) and each stage's read."""
    lines = [*(f"  util.global private @__ring_slot{slot} : !hal.buffer" for slot in range(SLOTS)),
             "  util.global private mutable @__ring_current : index",
             "  util.global private mutable @__ring_ready : !hal.fence",
             "  util.initializer {", *_indent(_device(), 4),
             f"    %size = arith.constant {plan.slot_bytes} : index",
             "    %allocator = hal.device.allocator<%device : !hal.device> : !hal.allocator",
             '    %usage = hal.buffer_usage<"TransferSource|TransferTarget|Transfer|DispatchStorageRead|'
             'DispatchStorageWrite|DispatchStorage"> : i32',
             '    %memory = hal.memory_type<"DeviceVisible|DeviceLocal"> : i32']
    for slot in range(SLOTS):
        lines += [f"    %slot{slot} = hal.allocator.allocate<%allocator : !hal.allocator> affinity(%affinity) "
                  "type(%memory) usage(%usage) : !hal.buffer{%size}",
                  f"    util.global.store %slot{slot}, @__ring_slot{slot} : !hal.buffer"]
    lines += ["    %c0 = arith.constant 0 : index",
              '    %ready = hal.fence.create device(%device : !hal.device) flags("None") : !hal.fence',
              "    hal.fence.signal<%ready : !hal.fence>",
              "    util.global.store %c0, @__ring_current : index",
              "    util.global.store %ready, @__ring_ready : !hal.fence", "    util.return", "  }"]
    for index, pieces in enumerate(plan.stages):
        lines += _gather_function(index, pieces)
    return lines


def _device() -> list[str]:
    return ["%c0_device = arith.constant 0 : index", "%device = hal.devices.get %c0_device : !hal.device",
            "%affinity = arith.constant -1 : i64"]


def _indent(lines: list[str], spaces: int) -> list[str]:
    return [" " * spaces + line for line in lines]


def _gather_function(index: int, pieces: tuple[Piece, ...]) -> list[str]:
    """`@__ring_read_<index>(slot, wait) -> fence`: the stage's tensors read into `slot` after `wait`."""
    body = [*_device(), '%signal = hal.fence.create device(%device : !hal.device) flags("None") : !hal.fence',
            f'%scope = util.buffer.constant : !util.buffer = "{PARAMETER_SCOPE}"']
    reads = []
    for i, (key, start, offset, length) in enumerate(read for piece in pieces for read in piece.reads()):
        body += [f'%key{i} = util.buffer.constant : !util.buffer = "{key}"',
                 f"%start{i} = arith.constant {start} : i64",
                 f"%offset{i} = arith.constant {offset} : index",
                 f"%length{i} = arith.constant {length} : index"]
        reads.append(f"  %scope::%key{i}[%start{i}] -> %slot[%offset{i} for %length{i}] : !hal.buffer")
    body += ["io_parameters.gather<%device : !hal.device> affinity(%affinity) wait(%wait) signal(%signal) {",
             ",\n".join(reads), "}", "util.return %signal : !hal.fence"]
    return [f"  util.func private @__ring_read_{index}(%slot: !hal.buffer, %wait: !hal.fence) -> !hal.fence {{",
            *_indent(body, 4), "  }"]


def _fetch_function(name: str, stage: int, types: list[str], plan: RingPlan, prefetched: bool,
                    following: int | None) -> str:
    """One call site's fetch (see the module's docstring): the stage's tensors imported from its slot, read by the
    call before (`prefetched`) or here; the `following` stage read into the other slot once the activations
    entering this stage are computed."""
    pieces = plan.stages[stage]
    if len(pieces) != len(types) - 1:
        raise ValueError(f"stage {stage} takes {len(types) - 1} tensors; the ring plan has {len(pieces)}")
    body = [*_device(), "%c0 = arith.constant 0 : index", "%c1 = arith.constant 1 : index",
            '%done = hal.fence.create device(%device : !hal.device) flags("None") : !hal.fence',
            f"%x_done = hal.tensor.barrier join(%x : {types[0]}) => %done : !hal.fence",
            "%current = util.global.load @__ring_current : index",  # the slot of the last read
            "%last_read = util.global.load @__ring_ready : !hal.fence",
            "%slot0 = util.global.load @__ring_slot0 : !hal.buffer",
            "%slot1 = util.global.load @__ring_slot1 : !hal.buffer"]
    if prefetched:
        here, ready = "%current", "%last_read"
    else:
        here, ready = "%here", "%ready"
        body += ["%here = arith.subi %c1, %current : index",
                 '%after = hal.fence.join at([%done, %last_read]) flags("None") -> !hal.fence',
                 *_read(stage, here, "%after", ready)]
    body += _slot(here, "%slot")
    last, fence = here, ready
    if following is not None:
        body += [f"%other = arith.subi %c1, {here} : index",
                 f'%after_next = hal.fence.join at([%done, {ready}]) flags("None") -> !hal.fence',
                 *_read(following, "%other", "%after_next", "%next_ready")]
        last, fence = "%other", "%next_ready"
    body += [f"util.global.store {last}, @__ring_current : index",
             f"util.global.store {fence}, @__ring_ready : !hal.fence"]
    results = ["%x_done"]
    for i, (piece, tensor_type) in enumerate(zip(pieces, types[1:])):
        body += [f"%o{i} = arith.constant {piece.offset} : index", f"%l{i} = arith.constant {piece.length} : index",
                 f"%part{i} = hal.buffer.subspan<%slot : !hal.buffer>[%o{i}, %l{i}] : !hal.buffer",
                 f"%w{i} = hal.tensor.import wait({ready}) => %part{i} : !hal.buffer -> {tensor_type}"]
        results.append(f"%w{i}")
    body.append(f"util.return {', '.join(results)} : {', '.join(types)}")
    return "\n".join([f"  util.func private @{name}(%x: {types[0]}) -> ({', '.join(types)}) {{",
                      *_indent(body, 4), "  }"])


def _read(stage: int, slot_index: str, wait: str, signal: str) -> list[str]:
    """`stage` read into the slot numbered `slot_index` after `wait`; `signal` its fence."""
    slot = f"{signal}_slot"
    return [*_slot(slot_index, slot),
            f"{signal} = util.call @__ring_read_{stage}({slot}, {wait}) : (!hal.buffer, !hal.fence) -> !hal.fence"]


def _slot(index: str, buffer: str) -> list[str]:
    """`buffer`: the ring's slot numbered `index` (0 or 1)."""
    return [f"{buffer}_is0 = arith.cmpi eq, {index}, %c0 : index",
            f"{buffer} = arith.select {buffer}_is0, %slot0, %slot1 : !hal.buffer"]
