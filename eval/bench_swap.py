# pyright: reportRedeclaration=false
# (each backend defines its own `run`)
"""Benchmark: staged (swap) execution against resident execution, at device memory budgets of 100%,
50% and 25% of the weight bytes (plus the KV state), on a random-weights config big enough that staging matters. Each
budget runs in its own process so its peak RSS is its own. Medians; nothing is asserted.

    python -m eval.bench_swap [--backend jax|iree-host] [--policy vanilla|dual-cache] [--prompt-length 32] [--repeats 5]

A bundle's program reads its own weights (`lowering.stage_ring`), so its rows have no copy counters; a budget a
backend cannot run in is a row saying why.

On a CPU "device" the copy into a staging slot is a memcpy that competes with compute for the same
cores (an accelerator's DMA engine would not), so the slowdown shrinks as compute per streamed byte
grows: a longer canvas (`--prompt-length`) or full-canvas steps (`vanilla`) hide more of it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import llada_jax
from llada_jax.bundle_runner import bundle_runner
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import hf_shapes, init_params
from llada_jax.model.shapes import bucket
from llada_jax.staging.swap import kv_bytes
from llada_jax.system.errors import LladaError
from llada_jax.system.locations import user_cache_dir
from llada_jax.weights.checkpoint import save_hf
from lowering.bundle_cache import cached_bundle

SWAP_CONFIG = LLaDAConfig(d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16, mlp_hidden_size=2816,
                          vocab_size=32000, embedding_size=32000, max_sequence_length=256, mask_token_id=31999,
                          eos_token_id=31998, eot_token_id=31997)
FRACTIONS = (None, 1.0, 0.5, 0.25)  # None: resident, no budget
GEN_LENGTH = 32


def model_dir() -> Path:
    out = user_cache_dir("bench-models") / "swap-d1024-l16"
    if not (out / "config.json").is_file():
        save_hf(init_params(SWAP_CONFIG, seed=0), SWAP_CONFIG, out)
    return out


def weight_bytes() -> int:
    return sum(int(np.prod(s)) for s in hf_shapes(SWAP_CONFIG).values()) * 4


def measure(fraction: float | None, backend: str, repeats: int, policy: str, prompt_length: int = 32) -> dict:
    """One budget, in this process: median latency of one generation and its staging counters."""
    # A budget is a fraction of the weight bytes plus room for this workload's KV state (64 slots).
    canvas = bucket(prompt_length + GEN_LENGTH, SWAP_CONFIG.max_sequence_length)
    budget = None if fraction is None else int(fraction * weight_bytes()) + kv_bytes(SWAP_CONFIG, 1, canvas, 4)
    prompt = np.random.default_rng(0).integers(0, 31000, prompt_length)
    options = {"gen_length": GEN_LENGTH, "block_length": 8, "steps": GEN_LENGTH, "policy": policy}
    if backend == "jax":
        model = llada_jax.load(model_dir(), device_memory_budget=budget)

        def run():
            return llada_jax.generate(model, prompt, **options)
    else:
        _, _, generate = bundle_runner(cached_bundle(model_dir(), "host", max_len=canvas, window=8,
                                                   device_memory_budget=budget))

        def run():
            return generate(prompt, **options)

    run()
    times, stats = [], {}
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        assert not isinstance(result, list), "one prompt gives one result"
        stats = result.stats
        times.append(time.perf_counter() - started)
    return {"budget_fraction": fraction, "budget_bytes": budget, "median_s": statistics.median(times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **stats}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="jax", choices=["jax", "iree-host"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policy", default="dual-cache", help="decoder (vanilla: full-canvas steps, more compute "
                                                                 "per streamed byte)")
    parser.add_argument("--prompt-length", type=int, default=32,
                        help="prompt tokens before the 32 generated ones (the canvas is their sum, bucketed)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one budget
    args = parser.parse_args(argv)
    if args.one is not None:
        fraction = None if args.one == "resident" else float(args.one)
        try:
            print(json.dumps(measure(fraction, args.backend, args.repeats, args.policy, args.prompt_length)))
        except LladaError as error:  # a budget this backend cannot run in (a bundle's ring holds the whole head)
            print(json.dumps({"budget_fraction": fraction, "refused": str(error)}))
        return
    model_dir()
    rows = []
    for fraction in FRACTIONS:
        child = [sys.executable, "-m", "eval.bench_swap", "--backend", args.backend, "--repeats", str(args.repeats),
                 "--policy", args.policy, "--prompt-length", str(args.prompt_length),
                 "--one", "resident" if fraction is None else str(fraction)]
        rows.append(json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout))
    resident = rows[0]["median_s"]
    print(f"weights {weight_bytes() / 2**20:.0f} MiB, backend {args.backend}, {args.policy}, "
          f"prompt {args.prompt_length} + {GEN_LENGTH} generated tokens")
    print(f"{'budget':<12}{'median s':>10}{'vs resident':>13}{'staged MiB':>12}{'copy s':>9}{'hidden':>8}"
          f"{'RSS MiB':>9}")
    for row in rows:
        name = "resident" if row["budget_fraction"] is None else f"{row['budget_fraction']:.0%}"
        if "refused" in row:
            print(f"{name:<12}refused: {row['refused']}")
            continue
        print(f"{name:<12}{row['median_s']:>10.3f}{row['median_s'] / resident:>13.2f}"
              f"{_column(row, 'bytes_staged', 12, '.0f', 2**20)}{_column(row, 'copy_seconds', 9, '.3f')}"
              f"{_column(row, 'hidden_fraction', 8, '.2f')}{row['peak_rss_mb']:>9.0f}")


def _column(row: dict, key: str, width: int, spec: str, unit: float = 1.0) -> str:
    """A staging counter, or "-" where the run has none (resident, or a bundle whose program reads its own)."""
    return f"{row[key] / unit:>{width}{spec}}" if key in row else f"{'-':>{width}}"


if __name__ == "__main__":
    main()
