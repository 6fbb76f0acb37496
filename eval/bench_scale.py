"""Benchmark at LLaDA-8B's real shapes: load time, peak RSS and time per forward pass for each weight
form, against the floor (the pass's model FLOPs / this machine's float32 matmul peak, measured in the
same run). Each setting runs in its own process so its peak RSS is its own. Nothing is asserted.

    python -m eval.scale_checkpoint --out /tmp/llada-8b-random            # bf16, ~16 GB, ~1 min
    llada quantize --model /tmp/llada-8b-random --out /tmp/llada-8b-int8 --bits 8
    llada quantize --model /tmp/llada-8b-random --out /tmp/llada-8b-int4 --bits 4 --group-size 32
    llada compile --model /tmp/llada-8b-int4 --target host --out /tmp/llada-8b-int4-host --no-loop \\
        --max-len 160 --window 32                                          # the phone path's IREE steps
    python -m eval.bench_scale --setting bf16=/tmp/llada-8b-random --setting int8=/tmp/llada-8b-int8 \\
        --setting int8-w8a8=/tmp/llada-8b-int8:int8 --setting int4=/tmp/llada-8b-int4 \\
        --setting int4-iree=/tmp/llada-8b-int4-host [--budget 2000000000] \\
        [--llama-bench llama.cpp/build/bin/llama-bench --gguf Q4_0=llada-8b-Q4_0.gguf] \
        [--reference Fast-dLLM --reference-python torch-venv/bin/python]

A forward pass is one vanilla step over the whole canvas: 16 prompt + 16 generated positions (32), and 32 +
128 (160); a setting that is a bundle runs through IREE without JAX (`llada_jax.bundle_runner`), and reports
IREE's allocator peak beside the peak RSS (device-local allocations; IREE's multithreaded driver leaves
queue-ordered transients out of it, so the peak RSS is the figure to trust); on an accelerator, JAX's rows
report its memory's peak the same way. `--budget` adds the checkpoints
staged through that much device memory. A peer row runs llama.cpp's `llama-bench -p 32,160 -n 0` on a GGUF
with as many threads as this process may use. `--reference` adds the PyTorch reference model (Fast-dLLM's
`modeling_llada`, logits at every position) on the first float checkpoint, same dtype and threads. `first s`
is the load plus the first call: ours a warm-up of two forwards that also compiles; the reference's one
forward, which pages in its memory-mapped weights.
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

import jax
import numpy as np

import llada_jax
from eval.bench import matmul_peak_gflops, step_flops
from eval.reference_bench import check_checkout, reference_forward
from llada_jax.backends.select import open_bundle
from llada_jax.bundle_runner import generate_with_bundle
from llada_jax.model.config import LLaDAConfig, read_config
from llada_jax.system.errors import LladaError
from llada_jax.system.host_cpu import describe, usable_threads
from llada_jax.weights.weights_io import checkpoint_quantization
from lowering.bundle_format import MANIFEST

CANVASES = ((16, 16), (32, 128))  # (prompt, generated) positions
REPEATS = 3


def forward_pass(generate, config, prompt: int, generated: int) -> tuple[float, float, float]:
    """Seconds of the warm-up call, then median seconds and bytes streamed per full-canvas forward pass
    (vanilla steps) of `generate(ids, **options)`."""
    ids = np.random.default_rng(0).integers(0, min(config.vocab_size, config.mask_token_id), prompt)
    # The warm-up is the timed call itself: the compiled loop is compiled per step count.
    # top_k 0: a pass reads out the argmax on every family (Dream's default confidence filter reads logits).
    options = {"gen_length": generated, "block_length": generated, "policy": "vanilla", "steps": 2, "top_k": 0}
    started = time.perf_counter()
    generate(ids, **options)
    times, streamed = [time.perf_counter() - started], []
    for _ in range(REPEATS):
        started = time.perf_counter()
        result = generate(ids, **options)
        times.append((time.perf_counter() - started) / result.nfe)
        streamed.append(result.stats.get("bytes_staged", 0) / result.nfe)
    return times[0], statistics.median(times[1:]), statistics.median(streamed)


def measure(path: str, activations: str, kernels: str, dtype: str, budget: int | None) -> dict:
    """One checkpoint through XLA (`llada_jax.load`), or one bundle through IREE."""
    if (Path(path) / MANIFEST).is_file():
        return measure_bundle(Path(path))
    started = time.perf_counter()
    model = llada_jax.load(path, dtype=dtype, device_memory_budget=budget, activations=activations, kernels=kernels)
    row = {"load_s": time.perf_counter() - started, "weight_bytes": model.weight_bytes}
    row = canvas_rows(row, lambda ids, **options: llada_jax.generate(model, ids, **options), model.config,
                      model.config.max_sequence_length)
    stats = jax.devices()[0].memory_stats() or {}  # an accelerator's own memory; none on a CPU
    if "peak_bytes_in_use" in stats:
        row["device_peak_bytes"] = stats["peak_bytes_in_use"]
    return row


def measure_bundle(path: Path) -> dict:
    started = time.perf_counter()
    opened = open_bundle(path, "iree-host")
    listed = opened.bundle.manifest["weights"]["files"]
    files = [Path(file) if Path(file).is_absolute() else path / file for file in listed]
    row = {"load_s": time.perf_counter() - started, "weight_bytes": sum(file.stat().st_size for file in files)}
    limit = opened.bundle.manifest["max_len"]
    row = canvas_rows(row, lambda ids, **options: generate_with_bundle(opened, ids, **options), opened.config, limit)
    row["device_peak_bytes"] = opened.session.device.allocator.statistics["device_bytes_peak"]
    return row


def canvas_rows(row: dict, generate, config, limit: int) -> dict:
    """`row` with the forward time and bytes streamed of each canvas (those within `limit` positions)."""
    for prompt, generated in CANVASES:
        if prompt + generated <= limit:
            first, seconds, streamed = forward_pass(generate, config, prompt, generated)
            row.setdefault("first_s", row["load_s"] + first)
            row[f"forward_s_{prompt + generated}"] = seconds
            row[f"streamed_bytes_{prompt + generated}"] = streamed
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def measure_peer(llama_bench: str, gguf: str) -> dict:
    """llama.cpp's time per forward over each canvas's positions (`llama-bench -p N -n 0`: one non-causal
    pass with logits at every position), same thread count, and its peak RSS."""
    widths = ",".join(str(prompt + generated) for prompt, generated in CANVASES)
    command = [llama_bench, "-m", gguf, "-p", widths, "-n", "0", "-r", str(REPEATS),
               "-t", str(usable_threads()), "-o", "jsonl"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    row = {"load_s": None, "weight_bytes": Path(gguf).stat().st_size}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            row[f"forward_s_{result['n_prompt']}"] = result["avg_ns"] / 1e9
            row[f"streamed_bytes_{result['n_prompt']}"] = 0
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return row


def reference_row(args, config) -> dict:
    """The PyTorch reference model on the first float checkpoint among the settings (see the docstring)."""
    paths = [parse_setting(setting)[1] for setting in args.setting]
    floats = [p for p in paths if not (p / MANIFEST).is_file() and not checkpoint_quantization(p, read_config(p))]
    if not floats:
        raise LladaError("--reference runs the reference model on a float checkpoint; no --setting is one")
    widths = [p + g for p, g in CANVASES if p + g <= config.max_sequence_length]
    row = reference_forward(args.reference, args.reference_python, floats[0], args.dtype,
                            min(config.vocab_size, config.mask_token_id), widths, REPEATS)
    row["first_s"] += row["load_s"]
    weights = sum(file.stat().st_size for file in floats[0].glob("*.safetensors"))
    return {"setting": "reference", "mode": f"torch {args.dtype}", "weight_bytes": weights, **row}


def run_child(name: str, mode: str, arguments: list[str]) -> dict:
    """One row measured in a child process of its own (`--one ...`), so its peak RSS is its own."""
    done = subprocess.run([sys.executable, "-m", "eval.bench_scale", *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["failed"])[-1]
        return {"setting": name, "mode": mode, "error": last.removeprefix("llada_jax.system.errors.LladaError: ")}
    return {"setting": name, "mode": mode, **json.loads(done.stdout)}


SETTING_OPTIONS = {"int8": "int8 activations (W4A8 / W8A8)", "compiler": "XLA's code for the quantized matmuls"}


def parse_setting(setting: str) -> tuple[str, Path, str, str]:
    """`NAME=DIR[:int8][:compiler]` -> (name, directory, activations, kernels)."""
    name, _, spec = setting.partition("=")
    path, *options = spec.split(":")
    unknown = [option for option in options if option not in SETTING_OPTIONS]
    if unknown:
        raise LladaError(f"unknown setting option {unknown[0]!r} in {setting!r}; options: {', '.join(SETTING_OPTIONS)}")
    return name, Path(path), "int8" if "int8" in options else "float", "compiler" if "compiler" in options else "own"


def setting_rows(setting: str, dtype: str, budget: int | None) -> list[dict]:
    name, path, activations, kernels = parse_setting(setting)
    if (path / MANIFEST).is_file():
        return [run_child(name, "IREE bundle", ["--one", f"{path}:float:own"])]
    rows = []
    for each in (None, budget) if budget else (None,):
        arguments = ["--one", f"{path}:{activations}:{kernels}", "--dtype", dtype]
        if each is not None:
            arguments += ["--budget", str(each)]
        rows.append(run_child(name, "resident" if each is None else f"staged {each / 1e9:.1f} GB", arguments))
    return rows


def _cell(value, width: int, digits: int, scale: float = 1.0) -> str:
    return f"{'-':>{width}}" if value is None else f"{value / scale:>{width}.{digits}f}"


def print_table(rows: list[dict], config, peak: float) -> None:
    print(f"CPU: {describe()}; {usable_threads()} threads")
    print(f"float32 matmul peak {peak:.1f} GFLOP/s; floor = forward FLOPs / peak")
    print(f"{'setting':<15}{'mode':<16}{'weights GB':>11}{'load s':>8}{'first s':>8}{'peak RSS GB':>12}"
          f"{'device GB':>10}"
          + "".join(f"{f'fwd{p + g} s':>10}{'xfloor':>8}{'streamed GB':>12}" for p, g in CANVASES))
    for row in rows:
        if "error" in row:
            print(f"{row['setting']:<15}{row['mode']:<16} {row['error']}")
            continue
        line = (f"{row['setting']:<15}{row['mode']:<16}{row['weight_bytes'] / 1e9:>11.2f}{_cell(row['load_s'], 8, 1)}"
                f"{_cell(row.get('first_s'), 8, 1)}"
                f"{row['peak_rss_bytes'] / 1e9:>12.2f}{_cell(row.get('device_peak_bytes'), 10, 2, 1e9)}")
        for prompt, generated in CANVASES:
            width = prompt + generated
            seconds = row.get(f"forward_s_{width}")
            floor = step_flops(config, width, width) / (peak * 1e9)
            line += (_cell(seconds, 10, 2) + _cell(None if seconds is None else seconds / floor, 8, 2)
                     + _cell(row.get(f"streamed_bytes_{width}"), 12, 2, 1e9))
        print(line)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=DIR[:int8][:compiler]",
                        help="a checkpoint (':int8': int8 activations, W4A8 / W8A8; ':compiler': XLA's code, not our "
                             "kernels) or a compiled bundle to measure; repeat for several")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (default bfloat16)")
    parser.add_argument("--budget", type=int, default=None, help="also run each checkpoint staged at this budget")
    parser.add_argument("--llama-bench", default=None, metavar="BIN", help="llama.cpp's llama-bench, for peer rows")
    parser.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE",
                        help="a GGUF for a peer row (with --llama-bench); repeat for several")
    parser.add_argument("--reference", default=None, metavar="DIR",
                        help="a checkout of Fast-dLLM: its PyTorch model timed on the first float checkpoint")
    parser.add_argument("--reference-python", default=sys.executable, metavar="PYTHON",
                        help="interpreter with torch and transformers for --reference (default: this one)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one setting
    parser.add_argument("--one-peer", default=None, help=argparse.SUPPRESS)  # child process: one GGUF
    args = parser.parse_args(argv)
    if args.one is not None:
        path, activations, kernels = args.one.rsplit(":", 2)
        print(json.dumps(measure(path, activations, kernels, args.dtype, args.budget)))
        return
    if args.one_peer is not None:
        print(json.dumps(measure_peer(args.llama_bench, args.one_peer)))
        return
    if not args.setting:
        parser.error("give at least one --setting NAME=DIR")
    if args.gguf and not args.llama_bench:
        parser.error("--gguf needs --llama-bench BIN")
    try:
        for setting in args.setting:
            parse_setting(setting)
        if args.reference:
            check_checkout(args.reference, args.reference_python)
    except LladaError as err:
        parser.error(str(err))
    rows = []
    for setting in args.setting:
        rows += setting_rows(setting, args.dtype, args.budget)
        print(f"measured {parse_setting(setting)[0]}", file=sys.stderr, flush=True)
    for gguf in args.gguf:
        name, _, file = gguf.partition("=")
        rows.append(run_child(name, "llama.cpp", ["--llama-bench", args.llama_bench, "--one-peer", file]))
        print(f"measured {name}", file=sys.stderr, flush=True)
    config = model_config(parse_setting(args.setting[0])[1])
    if args.reference:
        try:
            rows.append(reference_row(args, config))
        except LladaError as err:
            rows.append({"setting": "reference", "mode": f"torch {args.dtype}", "error": str(err)})
        print("measured the reference", file=sys.stderr, flush=True)
    peak = matmul_peak_gflops()
    if args.json:
        print(json.dumps({"cpu": describe(), "peak_gflops": peak, "rows": rows}, indent=2))
    else:
        print_table(rows, config, peak)


def model_config(path: Path) -> LLaDAConfig:
    """The model config of a checkpoint or a bundle (from its manifest: no checksums of its weights)."""
    if (path / MANIFEST).is_file():
        return LLaDAConfig.from_hf_dict(json.loads((path / MANIFEST).read_text())["model_config"])
    return read_config(path)


if __name__ == "__main__":
    main()
