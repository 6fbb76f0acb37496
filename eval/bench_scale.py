"""Benchmark at LLaDA-8B's real shapes: load time, peak RSS and time per forward pass for each weight
form, against the floor (the pass's model FLOPs / this machine's float32 matmul peak, measured in the
same run). Each setting runs in its own process so its peak RSS is its own. Nothing is asserted.

    python -m eval.scale_checkpoint --out /tmp/llada-8b-random            # bf16, ~16 GB, ~1 min
    llada quantize --model /tmp/llada-8b-random --out /tmp/llada-8b-int8 --bits 8
    llada quantize --model /tmp/llada-8b-random --out /tmp/llada-8b-int4 --bits 4 --group-size 32
    python -m eval.bench_scale --setting bf16=/tmp/llada-8b-random --setting int8=/tmp/llada-8b-int8 \\
        --setting int8-w8a8=/tmp/llada-8b-int8:int8 --setting int4=/tmp/llada-8b-int4 [--budget 2000000000]

A forward pass is one vanilla step over the whole canvas: 16 prompt + 16 generated positions (32), and
32 + 128 (160). `--budget` adds the same settings staged through that much device memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

import llada_jax
from eval.bench import matmul_peak_gflops, step_flops
from llada_jax.config import read_config

CANVASES = ((16, 16), (32, 128))  # (prompt, generated) positions
REPEATS = 3


def forward_pass(model, prompt: int, generated: int) -> tuple[float, float]:
    """Median seconds and bytes streamed per full-canvas forward pass (vanilla steps), after a warm-up."""
    ids = np.random.default_rng(0).integers(0, min(model.config.vocab_size, model.config.mask_token_id), prompt)
    # The warm-up is the timed call itself: the compiled loop is compiled per step count.
    options = {"gen_length": generated, "block_length": generated, "policy": "vanilla", "steps": 2}
    llada_jax.generate(model, ids, **options)
    times, streamed = [], []
    for _ in range(REPEATS):
        started = time.perf_counter()
        result = llada_jax.generate(model, ids, **options)
        times.append((time.perf_counter() - started) / result.nfe)
        streamed.append(result.stats.get("bytes_staged", 0) / result.nfe)
    return statistics.median(times), statistics.median(streamed)


def measure(path: str, activations: str, dtype: str, budget: int | None) -> dict:
    started = time.perf_counter()
    model = llada_jax.load(path, dtype=dtype, device_memory_budget=budget, activations=activations)
    row = {"load_s": time.perf_counter() - started, "weight_bytes": model.weight_bytes}
    for prompt, generated in CANVASES:
        seconds, streamed = forward_pass(model, prompt, generated)
        row[f"forward_s_{prompt + generated}"] = seconds
        row[f"streamed_bytes_{prompt + generated}"] = streamed
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def run_child(name: str, spec: str, dtype: str, budget: int | None) -> dict:
    path, _, activations = spec.partition(":")
    child = [sys.executable, "-m", "eval.bench_scale", "--one", f"{path}:{activations or 'float'}", "--dtype", dtype]
    if budget is not None:
        child += ["--budget", str(budget)]
    done = subprocess.run(child, capture_output=True, text=True)
    mode = "resident" if budget is None else f"staged {budget / 1e9:.1f} GB"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"setting": name, "mode": mode, "error": last.removeprefix("llada_jax.errors.LladaError: ")}
    return {"setting": name, "mode": mode, **json.loads(done.stdout)}


def print_table(rows: list[dict], config, peak: float) -> None:
    print(f"float32 matmul peak {peak:.1f} GFLOP/s; floor = forward FLOPs / peak")
    print(f"{'setting':<12}{'mode':<16}{'weights GB':>11}{'load s':>8}{'peak RSS GB':>12}"
          + "".join(f"{f'fwd{p + g} s':>10}{'xfloor':>8}{'streamed GB':>12}" for p, g in CANVASES))
    for row in rows:
        if "error" in row:
            print(f"{row['setting']:<12}{row['mode']:<16} {row['error']}")
            continue
        line = (f"{row['setting']:<12}{row['mode']:<16}{row['weight_bytes'] / 1e9:>11.2f}{row['load_s']:>8.1f}"
                f"{row['peak_rss_bytes'] / 1e9:>12.2f}")
        for prompt, generated in CANVASES:
            width = prompt + generated
            floor = step_flops(config, width, width) / (peak * 1e9)
            seconds = row[f"forward_s_{width}"]
            line += f"{seconds:>10.2f}{seconds / floor:>8.2f}{row[f'streamed_bytes_{width}'] / 1e9:>12.2f}"
        print(line)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=DIR[:int8]",
                        help="a checkpoint to measure (':int8': W8A8 activations); repeat for several")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (default bfloat16)")
    parser.add_argument("--budget", type=int, default=None, help="also run each setting staged at this budget")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one setting
    args = parser.parse_args(argv)
    if args.one is not None:
        path, activations = args.one.rsplit(":", 1)
        print(json.dumps(measure(path, activations, args.dtype, args.budget)))
        return
    if not args.setting:
        parser.error("give at least one --setting NAME=DIR")
    rows = []
    for setting in args.setting:
        name, _, spec = setting.partition("=")
        for budget in (None, args.budget) if args.budget else (None,):
            rows.append(run_child(name, spec, args.dtype, budget))
            print(f"measured {name} {rows[-1]['mode']}", file=sys.stderr, flush=True)
    config = read_config(args.setting[0].partition("=")[2].partition(":")[0])
    peak = matmul_peak_gflops()
    if args.json:
        print(json.dumps({"peak_gflops": peak, "rows": rows}, indent=2))
    else:
        print_table(rows, config, peak)


if __name__ == "__main__":
    main()
