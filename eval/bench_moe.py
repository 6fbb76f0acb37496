"""One sparse MoE layer at LLaDA-MoE-7B-A1B's shapes (d_model 2048, 64 experts of 1024, top 8) against its
floors: the routed experts' FLOPs at this machine's matmul peak (measured in the same run), and a dense SwiGLU
of the same FLOPs (hidden 8 x 1024: what the routed work costs when it is one matmul). Beside them, every
expert on every position (the dense-masked cost a grouped matmul without routing would pay). Nothing asserted.

    python -m eval.bench_moe [--dtype bfloat16] [--rows 32 160]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from eval.bench import matmul_peak_gflops
from llada_jax.host_cpu import describe
from llada_jax.moe import sparse_mlp

D_MODEL, EXPERTS, HIDDEN, TOP = 2048, 64, 1024, 8
REPEATS = 5


def timed(function, *args) -> float:
    """Median seconds of `function(*args)` after a warm-up (compile) call."""
    jax.block_until_ready(function(*args))
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def swiglu(x, gate, up, down):
    g = jnp.einsum("rd,hd->rh", x, gate, preferred_element_type=jnp.float32).astype(x.dtype)
    u = jnp.einsum("rd,hd->rh", x, up, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum("rh,dh->rd", jax.nn.silu(g) * u, down, preferred_element_type=jnp.float32).astype(x.dtype)


def all_experts(x, block):
    """Every expert on every row, weighted by the full softmax (the cost routing avoids)."""
    return jnp.einsum("erd->rd", jax.vmap(lambda g, u, d: swiglu(x, g, u, d))(
        block["experts_gate"], block["experts_up"], block["experts_down"]))


def measure(rows: int, dtype, peak: float, rng: np.random.Generator) -> dict:
    def weights(*shape):
        return jnp.asarray(rng.normal(0, 0.02, shape), dtype)

    block = {"router": weights(EXPERTS, D_MODEL), "experts_gate": weights(EXPERTS, HIDDEN, D_MODEL),
             "experts_up": weights(EXPERTS, HIDDEN, D_MODEL), "experts_down": weights(EXPERTS, D_MODEL, HIDDEN)}
    x = jnp.asarray(rng.normal(0, 1, (1, rows, D_MODEL)), dtype)
    active_flops = 2 * rows * TOP * 3 * D_MODEL * HIDDEN + 2 * rows * D_MODEL * EXPERTS
    dense = [weights(TOP * HIDDEN, D_MODEL), weights(TOP * HIDDEN, D_MODEL), weights(D_MODEL, TOP * HIDDEN)]
    moe_s = timed(jax.jit(lambda b, x: sparse_mlp(b, x, TOP)), block, x)
    return {"rows": rows, "dtype": jnp.dtype(dtype).name, "moe_ms": 1e3 * moe_s,
            "floor_ms": 1e3 * active_flops / (peak * 1e9),
            "same_flops_dense_ms": 1e3 * timed(jax.jit(swiglu), x[0], *dense),
            "all_experts_ms": 1e3 * timed(jax.jit(all_experts), x[0], block),
            "active_gflop": active_flops / 1e9, "peak_gflops": peak}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 160])
    args = parser.parse_args(argv)
    print(describe())
    peak = max(matmul_peak_gflops() for _ in range(3))
    rng = np.random.default_rng(0)
    for rows in args.rows:
        row = measure(rows, jnp.dtype(args.dtype), peak, rng)
        print(json.dumps({key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()}))


if __name__ == "__main__":
    main()
