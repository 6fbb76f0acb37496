"""One sparse MoE layer at LLaDA-MoE-7B-A1B's shapes (d_model 2048, 64 experts of 1024, top 8) against its
floors: the routed experts' FLOPs at this machine's matmul peak, the bytes of the experts the routing touches
at this machine's read bandwidth (both measured in the same run), and a dense SwiGLU of the same FLOPs (hidden
8 x 1024: the routed work as one matmul). Beside them, every expert on every position (the dense-masked cost a
grouped matmul without routing would pay). Nothing asserted.

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
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.moe import sparse_mlp
from llada_jax.system.host_cpu import describe

D_MODEL, EXPERTS, HIDDEN, TOP = 2048, 64, 1024, 8
ROUTING = LLaDAConfig(d_model=D_MODEL, n_layers=1, n_heads=16, n_kv_heads=16, mlp_hidden_size=HIDDEN, vocab_size=1,
                      embedding_size=1, max_sequence_length=1, mask_token_id=0, n_experts=EXPERTS,
                      experts_per_token=TOP)  # LLaDA-MoE's softmax router
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


def read_bandwidth(size: int = 1 << 28) -> float:
    """Bytes per second XLA reads a float32 array too large for the caches (a sum over 1 GB)."""
    array = jnp.ones((size,), jnp.float32)
    return 4 * size / timed(jax.jit(jnp.sum), array)


def touched_experts(rows: int) -> float:
    """Experts the routing is expected to touch for `rows` positions (uniform routing)."""
    return EXPERTS * (1 - (1 - TOP / EXPERTS) ** rows)


def swiglu(x, gate, up, down):
    g = jnp.einsum("rd,hd->rh", x, gate, preferred_element_type=jnp.float32).astype(x.dtype)
    u = jnp.einsum("rd,hd->rh", x, up, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum("rh,dh->rd", jax.nn.silu(g) * u, down, preferred_element_type=jnp.float32).astype(x.dtype)


def all_experts(x, block):
    """Every expert on every row, weighted by the full softmax (the cost routing avoids)."""
    return sum(swiglu(x, g, u, d) for g, u, d in zip(block["experts_gate"], block["experts_up"],
                                                       block["experts_down"]))


def measure(rows: int, dtype, peak: float, bandwidth: float, rng: np.random.Generator) -> dict:
    def weights(*shape):
        return jnp.asarray(rng.normal(0, 0.02, shape), dtype)

    block = {"router": weights(EXPERTS, D_MODEL), "experts_gate": [weights(HIDDEN, D_MODEL) for _ in range(EXPERTS)],
             "experts_up": [weights(HIDDEN, D_MODEL) for _ in range(EXPERTS)],
             "experts_down": [weights(D_MODEL, HIDDEN) for _ in range(EXPERTS)]}
    x = jnp.asarray(rng.normal(0, 1, (1, rows, D_MODEL)), dtype)
    active_flops = 2 * rows * TOP * 3 * D_MODEL * HIDDEN + 2 * rows * D_MODEL * EXPERTS
    expert_bytes = 3 * D_MODEL * HIDDEN * jnp.dtype(dtype).itemsize
    dense = [weights(TOP * HIDDEN, D_MODEL), weights(TOP * HIDDEN, D_MODEL), weights(D_MODEL, TOP * HIDDEN)]
    moe_s = timed(jax.jit(lambda b, x: sparse_mlp(b, x, ROUTING)), block, x)
    return {"rows": rows, "dtype": jnp.dtype(dtype).name, "moe_ms": 1e3 * moe_s,
            "flops_floor_ms": 1e3 * active_flops / (peak * 1e9),
            "bytes_floor_ms": 1e3 * touched_experts(rows) * expert_bytes / bandwidth,
            "same_flops_dense_ms": 1e3 * timed(jax.jit(swiglu), x[0], *dense),
            "all_experts_ms": 1e3 * timed(jax.jit(all_experts), x[0], block),
            "active_gflop": active_flops / 1e9, "peak_gflops": peak, "read_gb_per_s": bandwidth / 1e9}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 160])
    args = parser.parse_args(argv)
    print(describe())
    peak, bandwidth = max(matmul_peak_gflops() for _ in range(3)), read_bandwidth()
    rng = np.random.default_rng(0)
    for rows in args.rows:
        row = measure(rows, jnp.dtype(args.dtype), peak, bandwidth, rng)
        print(json.dumps({key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()}))


if __name__ == "__main__":
    main()
