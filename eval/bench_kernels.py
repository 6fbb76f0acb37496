"""Benchmark: one quantized matrix (default 4096 x 4096, int4 group 32 / int8 per channel) times a few columns,
through our kernels and through the compilers' own code, on XLA and in an IREE module, in one run. Median
milliseconds over repeated calls, the rate in GFLOP/s; nothing is asserted.

    python -m eval.bench_kernels                        # 32 columns
    python -m eval.bench_kernels --columns 160 --rows 12288

Rows: `xla own`/`iree own` are our kernels (`llada_jax/kernels`); `xla code` is XLA's own code for the same
weights (`--kernels compiler`); `iree code` is IREE's code generation for that same product (XLA's form of the
weights, without its hoisting barrier). Both IREE rows run on `local-task` with every core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from llada_jax.kernels import xla as own_kernels
from llada_jax.quant.qlinear import QuantizedWeight, quantized_linear, to_device
from llada_jax.quant.quantize import Activations, HostQuantized, QuantScheme, quantize_matrix
from llada_jax.system.host_cpu import describe, usable_threads
from lowering.bundle import compile_module
from lowering.kernel_dispatch import executable, rewrite_custom_calls, target_compiler, target_objects
from lowering.targets import target

CASES: dict[str, tuple[QuantScheme, Activations]] = {  # name -> (scheme, activations)
    "w4a8": (QuantScheme(4, 32), "int8"),
    "w4a16": (QuantScheme(4, 32), "float"),
    "w8a8": (QuantScheme(8), "int8"),
}


def median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def weights(rows: int, columns: int, scheme: QuantScheme, seed: int = 0) -> HostQuantized:
    w = np.random.default_rng(seed).normal(size=(rows, columns)).astype(np.float32)
    return HostQuantized.of(*quantize_matrix(w, scheme), scheme)


def xla_ms(x: jax.Array, weight: QuantizedWeight, repeats: int) -> float:
    product = jax.jit(lambda x, w: quantized_linear(x[None], w)[0])
    return median_ms(lambda: product(x, weight).block_until_ready(), repeats)


def iree_ms(x: np.ndarray, weight: QuantizedWeight, repeats: int, scratch: Path) -> float:
    """The same product exported with `jax.export`, our kernels' calls dispatched as a bundle does, compiled for
    this host and run on `local-task`."""
    import iree.runtime as rt
    from iree.compiler import ir

    weight = QuantizedWeight(weight.values, weight.scale, weight.activations, weight.row_block, hoist_barrier=False,
                             offset=weight.offset, nibbles=weight.nibbles, kernel=weight.kernel)
    leaves, tree = jax.tree.flatten(weight)
    run = jax.jit(lambda x, *parts: quantized_linear(x[None], jax.tree.unflatten(tree, parts))[0])
    checks = [export.DisabledSafetyCheck.custom_call(name) for name in own_kernels.TARGETS]
    exported = export.export(run, disabled_checks=checks)(x, *leaves)
    with ir.Context():  # pyright: ignore[reportAttributeAccessIssue] (printed as bundles print it: no locations)
        printed = ir.Module.parse(exported.mlir_module()).operation.get_asm(  # pyright: ignore
            enable_debug_info=False)
    text, calls = rewrite_custom_calls(printed)
    if calls:
        host = target("host")
        compiler = target_compiler(host)
        assert compiler is not None
        lines = text.strip().splitlines()
        text = "\n".join([lines[0], executable(target_objects(host, compiler, scratch)), *lines[1:]])
    compile_module(text, host_flags(), scratch / "m.vmfb")
    config = rt.Config("local-task")
    module = rt.VmModule.mmap(config.vm_instance, str(scratch / "m.vmfb"))
    main = getattr(rt.SystemContext(vm_modules=[module], config=config).modules, module.name)["main"]
    device_args = [rt.asdevicearray(config.device, np.asarray(a)) for a in (x, *leaves)]
    return median_ms(lambda: main(*device_args).to_host(), repeats)


def host_flags() -> tuple[str, ...]:
    return target("host").flags


def rows_for(columns: int, rows: int, out_columns: int, repeats: int) -> list[dict]:
    x = np.random.default_rng(1).normal(size=(out_columns, columns)).astype(np.float32)
    flops = 2 * rows * columns * out_columns
    out = []
    for name, (scheme, activations) in CASES.items():
        host = weights(rows, columns, scheme)
        own, theirs = to_device(host, activations, kernels="own"), to_device(host, activations)
        with tempfile.TemporaryDirectory(prefix="bench-kernels-") as scratch:
            times = {"xla own": xla_ms(jnp.asarray(x), own, repeats),
                     "iree own": iree_ms(x, own, repeats, Path(scratch))}
        if theirs.activations == activations:  # XLA's own code runs this scheme (4-bit W4A8 it does not)
            times["xla code"] = xla_ms(jnp.asarray(x), theirs, repeats)
            with tempfile.TemporaryDirectory(prefix="bench-kernels-") as scratch:
                times["iree code"] = iree_ms(x, theirs, repeats, Path(scratch))
        out += [{"kernel": name, "path": path, "ms": ms, "gflops": flops / ms / 1e6} for path, ms in times.items()]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="weight rows (outputs)")
    parser.add_argument("--inputs", type=int, default=4096, help="weight columns (a multiple of 32)")
    parser.add_argument("--columns", type=int, default=32, help="activation columns (positions)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.rows, args.columns, args.repeats) < 1 or args.inputs < 32 or args.inputs % 32:
        parser.error("--rows, --columns and --repeats must be positive; --inputs a positive multiple of 32")
    if own_kernels.available() is None:
        parser.exit(1, "bench_kernels: our kernels did not build here (see the line above)\n")
    rows = rows_for(args.inputs, args.rows, args.columns, args.repeats)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"CPU: {describe()}; {usable_threads()} threads; kernels: {own_kernels.load()}")
    print(f"one {args.rows} x {args.inputs} matrix, {args.columns} columns")
    for row in rows:
        print(f"{row['kernel']:<8} {row['path']:<10} {row['ms']:8.2f} ms {row['gflops']:7.0f} GFLOP/s")


if __name__ == "__main__":
    main()
