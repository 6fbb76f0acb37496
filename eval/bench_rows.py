"""Benchmark: how close to the matmul peak a step of W positions can get, from its decoder matmuls alone.

    python -m eval.bench_rows [--rows 32,64,96,128,192] [--layout positions|features|both] [--repeats 3] [--json]

Runs the 12 layers' projections of `llada bench --bench-size`'s model (q, k, v, attention output, gate,
up, down; random float32 weights, 617 MB, more than any cache) on W rows in each activation layout of
`llada_jax.model.layout` (position-major `x @ W.T`, feature-major `W @ h`), as a step does, without attention,
norms or the LM head, and reports the median time, GFLOP/s and the fraction of this machine's float32
matmul peak measured in the same run. This is the ceiling a step's `eff` column in `llada bench` can
reach with XLA's CPU matmuls. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import ENGINE_CONFIG, matmul_peak_gflops
from eval.bench_lowering import median_seconds
from llada_jax.model.layout import Features, Positions


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """Each projection's weight shape `[out, in]`, as the checkpoint stores it."""
    d, h, kv = config.d_model, config.mlp_hidden_size, config.n_kv_heads * config.head_dim
    return {"q": (d, d), "k": (kv, d), "v": (kv, d), "out": (d, d), "gate": (h, d), "up": (h, d), "down": (d, h)}


def random_layers(config, seed: int = 0) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)
    return [{name: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
             for name, shape in layer_shapes(config).items()} for _ in range(config.n_layers)]


def projections(layers, h: jax.Array, layout) -> jax.Array:
    """The data flow of a step's projections in `layout`: q/k/v from h (added where attention would combine
    them, K/V repeated over their query heads), the output projection, the gated MLP."""
    axis = layout.FEATURE_AXIS
    for w in layers:
        kv = layout.linear(h, w["k"]) + layout.linear(h, w["v"])
        attended = layout.linear(h, w["q"]) + jnp.repeat(kv, h.shape[axis] // kv.shape[axis], axis=axis)
        h = h + layout.linear(attended, w["out"])
        h = h + layout.linear(jax.nn.silu(layout.linear(h, w["gate"])) * layout.linear(h, w["up"]), w["down"])
    return h


def flops(config, rows: int) -> float:
    return 2.0 * rows * config.n_layers * sum(o * i for o, i in layer_shapes(config).values())


def time_rows(layers, rows: int, layout, repeats: int, seed: int = 1) -> float:
    """Median seconds of one pass over every layer for `rows` positions (`repeats` x 5 calls)."""
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((1, rows, ENGINE_CONFIG.d_model), np.float32))
    run = jax.jit(lambda layers, h: projections(layers, h, layout))
    h = layout.enter(x)
    return median_seconds(lambda: run(layers, h).block_until_ready(), 5 * repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,64,96,128,192", help="comma-separated positions per step")
    parser.add_argument("--layout", choices=("positions", "features", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows must be comma-separated positive integers, got {args.rows!r}")
    if min(rows) < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be positive")
    report(rows, args.layout, args.repeats, args.json)


def report(rows: list[int], layout: str, repeats: int, as_json: bool) -> None:
    layers = random_layers(ENGINE_CONFIG)
    layouts = {name: kind for name, kind in (("positions", Positions), ("features", Features))
               if layout in (name, "both")}
    peak = matmul_peak_gflops()
    results = []
    for width in rows:
        for name, kind in layouts.items():
            seconds = time_rows(layers, width, kind, repeats)
            gflops = flops(ENGINE_CONFIG, width) / seconds / 1e9
            results.append({"rows": width, "layout": name, "ms": seconds * 1e3, "gflops": gflops,
                            "fraction_of_peak": gflops / peak, "peak_gflops": peak})
    if as_json:
        print(json.dumps(results, indent=1))
        return
    print(f"float32 matmul peak (2048^2, this run): {peak:.0f} GFLOP/s")
    print(f"{'rows':>5} {'layout':>9} {'ms':>8} {'GFLOP/s':>8} {'of peak':>8}")
    for r in results:
        print(f"{r['rows']:>5} {r['layout']:>9} {r['ms']:>8.1f} {r['gflops']:>8.0f} {r['fraction_of_peak']:>8.0%}")


if __name__ == "__main__":
    main()
