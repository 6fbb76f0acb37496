"""The ring's read schedule (`lowering.stage_ring.rewrite_stage_calls`): over any program of stage calls, nested
in regions run any number of times, every call imports its own stage from a slot no read has overwritten since,
and a call followed by another in its region reads that call's stage while it computes. The ring is simulated
from the fetch functions' text: which stage each reads, into which slot, and which slot it imports."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from lowering.stage_ring import Piece, RingPlan, rewrite_stage_calls

STAGES = 5
PLAN = RingPlan(tuple((Piece((f"stage{i}.weight",), 0, 64),) for i in range(STAGES)))
X, W = "tensor<1x4xf32>", "tensor<4x4xf32>"
READ = re.compile(r"util\.call @__ring_read_(\d+)\(")


def call_line(stage: int, value: int) -> str:
    return (f"    %v{value}:2 = stablehlo.custom_call @llada_stage(%x, %w) {{api_version = 4 : i32, backend_config = "
            f"{{stage = {stage} : i64}}, has_side_effect = true}} : ({X}, {W}) -> ({X}, {W})")


# A program: stage calls, regions (a body run `times` times, printed as a loop's or a branch's) and calls to a
# function (its body defined after the caller's, as JAX exports a nested function; it may hold stage calls).
stage_calls = st.integers(0, STAGES - 1).map(lambda s: ("call", s))
FORMS = st.sampled_from(["while", "case"])
programs = st.recursive(
    st.lists(stage_calls, min_size=1, max_size=4),
    lambda inner: st.lists(st.one_of(stage_calls, st.tuples(st.just("region"), inner, st.integers(0, 3), FORMS),
                                     st.tuples(st.just("function"), inner)), min_size=1, max_size=4),
    max_leaves=12)


def module(program) -> tuple[str, list[int], list]:
    """MLIR-shaped text (a region as `stablehlo.while` or `stablehlo.case` prints it), the stage of
    each call in text order, and the program with each call's site (its fetch function's number) and each
    function call's body."""
    lines: list[str] = []
    calls: list[int] = []
    pending: list = [("main", program, [])]
    for name, body, sited in pending:  # grows as bodies call functions, each defined after its caller
        lines.append(f"  func.func private @{name}(%x: {X}) -> {X} {{")
        sited += render(body, lines, calls, pending)
        lines.append("  }")
    return "\n".join(lines), calls, pending[0][2]


def render(program, lines: list[str], calls: list[int], pending: list) -> list:
    sited: list = []
    for item in program:
        if item[0] == "call":
            sited.append(("call", item[1], len(calls)))
            calls.append(item[1])
            lines.append(call_line(item[1], len(calls)))
        elif item[0] == "region" and item[3] == "while":
            lines += [f"    %r = stablehlo.while(%i = %x) : {X}", "    cond {", "      stablehlo.return %c",
                      "    } do {"]
            sited.append(("region", render(item[1], lines, calls, pending), item[2]))
            lines.append("    }")
        elif item[0] == "region":  # the body is the first branch; the second returns at once
            lines.append('    %r = "stablehlo.case"(%i) ({')
            sited.append(("region", render(item[1], lines, calls, pending), item[2]))
            lines += ["      stablehlo.return %x", "    }, {", "      stablehlo.return %x",
                      f"    }}) : (tensor<i32>) -> {X}"]
        else:
            name = f"fn{len(pending)}"
            pending.append((name, item[1], []))
            sited.append(("region", pending[-1][2], 1))  # runs its body once, where it is called
            lines.append(f"    %f = call @{name}(%x) : ({X}) -> {X}")
    return sited


def run(program, functions: list[str], state: dict, trace: list) -> None:
    """Execute the program against the ring: `state` holds each slot's stage and the slot of the last read."""
    for item in program:
        if item[0] == "region":
            for _ in range(item[2]):
                run(item[1], functions, state, trace)
        else:
            slot = interpret(functions[item[2]], state)
            trace.append((item[1], state[slot]))  # the stage called, the stage its slot holds while it computes


def interpret(function: str, state: dict) -> int:
    """Run a fetch function's slot arithmetic, reads and global store on `state`; the slot its tensors are
    imported from."""
    values: dict[str, int | bool] = {}
    for line in function.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"(%\w+) = util\.global\.load @__ring_current : index", line):
            values[m[1]] = state["current"]
        elif m := re.fullmatch(r"(%\w+) = arith\.subi %c1, (%\w+) : index", line):
            values[m[1]] = 1 - values[m[2]]
        elif m := re.fullmatch(r"(%\w+) = arith\.cmpi eq, (%\w+), %c0 : index", line):
            values[m[1]] = values[m[2]] == 0
        elif m := re.fullmatch(r"(%\w+) = arith\.select (%\w+), %slot0, %slot1 : !hal\.buffer", line):
            values[m[1]] = 0 if values[m[2]] else 1
        elif m := re.search(r"= util\.call @__ring_read_(\d+)\((%\w+),", line):
            state[values[m[2]]] = int(m[1])
            state["reads"] += 1
        elif m := re.fullmatch(r"util\.global\.store (%\w+), @__ring_current : index", line):
            state["current"] = values[m[1]]
    imported = set(re.findall(r"hal\.buffer\.subspan<(%\w+) ", function))
    assert len(imported) == 1
    return int(values[imported.pop()])


def reads(function: str) -> list[int]:
    return [int(stage) for stage in READ.findall(function)]


@settings(max_examples=200, deadline=None)
@given(program=programs)
def test_every_call_imports_its_own_stage_and_a_chain_reads_ahead(program):
    text, calls, sited = module(program)
    rewritten, functions = rewrite_stage_calls(text, PLAN, "f__")
    assert "llada_stage" not in rewritten and len(functions) == len(calls)
    trace: list = []
    state = {"current": 0, 0: None, 1: None, "reads": 0}
    run(sited, functions, state, trace)
    assert all(called == held for called, held in trace)
    assert state["reads"] == len(trace)  # one read per call run: none repeated, none wasted


def test_consecutive_calls_in_one_region_read_ahead_and_a_region_edge_breaks_the_chain():
    helper = [("call", 3)]
    program = [("call", 0), ("call", 1), ("call", 2), ("region", [("call", 3), ("call", 4)], 2, "while"), ("call", 0),
               ("function", helper), ("call", 1), ("region", [("call", 2)], 1, "case"), ("call", 4)]
    _, functions = rewrite_stage_calls(module(program)[0], PLAN, "f__")
    # each call reads the next one's stage; a loop body's first call its own, as do the calls after the loop and
    # after the function call, the branch's and the one after it, and the function's own (defined last)
    assert [reads(f) for f in functions] == [[0, 1], [2], [], [3, 4], [], [0], [1], [2], [4], [3]]


def test_each_lm_head_chunk_is_fetched_after_the_logits_of_the_chunk_before():
    """A head chunk's fetch waits on what enters it, and the read it starts goes into the buffer the chunk before
    computed from: so what enters a chunk is the chunk before's logits (the first: the hidden states), and the
    logits join in chunk order."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from llada_jax.model.forward import head_logits
    from llada_jax.model.staged import Stage

    head = jnp.asarray(np.random.default_rng(0).standard_normal((13, 4)), jnp.float32)
    chunks = tuple(Stage(7 + c, (head[first:first + 5],), lambda arrays: arrays[0]) for c, first in
                   enumerate(range(0, 13, 5)))
    jaxpr = jax.make_jaxpr(lambda hidden: head_logits({"lm_head": chunks}, hidden)[0])(jnp.ones((1, 2, 4)))
    fetches = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "ffi_call"]
    assert [dict(eqn.params["attributes"])["stage"] for eqn in fetches] == [7, 8, 9]
    assert [eqn.invars[0].aval.shape for eqn in fetches] == [(1, 2, 4), (1, 2, 5), (1, 2, 5)]
    assert all(fetches[c].invars[0] in _produced_from(jaxpr, fetches[c - 1].outvars) for c in (1, 2))
    assert jaxpr.out_avals[0].shape == (1, 2, 13)


def _produced_from(jaxpr, sources) -> set:
    """The variables of `jaxpr` computed from `sources`."""
    reached = set(sources)
    for eqn in jaxpr.eqns:
        if reached & {v for v in eqn.invars if hasattr(v, "aval") and not hasattr(v, "val")}:
            reached |= set(eqn.outvars)
    return reached


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cuts=st.lists(st.integers(1, 39), max_size=4), seed=st.integers(0, 99))
def test_tables_in_row_chunks_give_the_whole_tables_rows_and_logits(rows, cuts, seed):
    """An embedding streamed in chunks of rows gives each token its row, and a head in chunks the whole head's
    logits, for any cut of the rows (each chunk's stage read run as its build on the stored tensors)."""
    from unittest import mock

    import jax.numpy as jnp
    import numpy as np

    import llada_jax.model.staged as staged
    from llada_jax.model.forward import embed, head_logits

    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.standard_normal((rows, 8)), jnp.float32)
    bounds = sorted({0, rows, *(c for c in cuts if c < rows)})
    chunks = tuple(staged.Stage(c, (table[a:b],), lambda arrays: arrays[0]) for c, (a, b) in
                   enumerate(zip(bounds, bounds[1:])))
    tokens = jnp.asarray(rng.integers(0, rows, (2, 5)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    with mock.patch.object(staged, "fetch", lambda part, x: (part.build(part.stored), x)):
        got_rows = embed(chunks, tokens, jnp.float32)
        got_logits = head_logits({"lm_head": chunks}, hidden)
    np.testing.assert_array_equal(got_rows, embed(table, tokens, jnp.float32))
    want = head_logits({"lm_head": table}, hidden)
    np.testing.assert_allclose(got_logits[0], jnp.moveaxis(want[0], want[1], 2), rtol=1e-5, atol=1e-5)
