"""Does IREE run the compiled block-diffusion loop with the checkpoint's own float weights (its experts, if any,
in loops)? The evidence behind `lowering.bundle.loop_refusal` for LLaDA2 outside our routed kernels: export
`policies.block_loop` for a block-diffusion checkpoint, compile it for the host CPU, run it in a child process
(IREE 3.13 crashed running it, or stopped) and compare its tokens with XLA's compiled loop.

    python -m eval.iree_block_loop_probe --model DIR [--editing-threshold 0.3]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import iree.runtime as rt
import jax.numpy as jnp
import numpy as np

import llada_jax
from llada_jax.model.config import read_config
from llada_jax.system.errors import LladaError
from lowering.bundle import compile_module
from lowering.bundle_format import PARAMETER_SCOPE
from lowering.bundle_module import bundle_module
from lowering.bundle_weights import weight_layout
from lowering.export import block_loop_function
from lowering.targets import compile_flags, target
from policies.block_diffusion import BlockSettings
from policies.block_loop_io import BlockLoopOutputs, block_loop_inputs, block_loop_spec, block_result
from policies.sampling import Sampler

PROMPT = np.arange(1, 6)
OPTIONS: dict = dict(gen_length=8, block_length=4, steps=4, threshold=0.3, max_post_steps=2)  # generate's keywords


def settings_of(args) -> BlockSettings:
    return BlockSettings(**OPTIONS, editing_threshold=args.editing_threshold)


def compile_loop(model_dir: Path, settings: BlockSettings, out: Path):
    config = read_config(model_dir)
    layout = weight_layout(model_dir, config)
    host = target("host")
    spec = block_loop_spec(settings, Sampler(), 16)
    assert spec is not None, "the probe's setting is one the compiled loop covers"
    function = block_loop_function(spec, config, jnp.float32, layout, "float", host.layout_rule(False))
    compile_module(bundle_module([function], layout, config), compile_flags(host, False, False, True), out)
    return spec


def run_loop(args) -> None:
    """In the child: run the compiled loop and print its tokens and passes."""
    settings = settings_of(args)
    spec = block_loop_spec(settings, Sampler(), 16)
    assert spec is not None
    config = rt.Config("local-task")
    index = rt.ParameterIndex()
    for file in sorted(Path(args.model).glob("*.safetensors")):
        index.load(str(file))
    params = rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=PARAMETER_SCOPE))
    module = rt.VmModule.mmap(config.vm_instance, args.run)
    context = rt.VmContext(config.vm_instance, modules=[rt.create_hal_module(config.vm_instance, config.device),
                                                        params, module])
    function = module.lookup_function(spec.name)
    assert function is not None, f"the module holds {spec.name}"
    out = rt.FunctionInvoker(context, config.device, function)(
        *(np.asarray(value) for value in block_loop_inputs(PROMPT, spec, settings)))
    assert isinstance(out, tuple), "the loop returns its outputs"
    result = block_result(BlockLoopOutputs(*(np.asarray(value.to_host()) for value in out)), spec, len(PROMPT),
                          settings.canvas_length(len(PROMPT)))
    print(",".join(map(str, result.output_ids.tolist())), result.nfe)


def main() -> int:
    parser = argparse.ArgumentParser(description="Does IREE run the compiled block-diffusion loop?")
    parser.add_argument("--model", required=True, help="a block-diffusion (LLaDA2) checkpoint")
    parser.add_argument("--editing-threshold", type=float, default=None, help="LLaDA2.1's decoder")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the child: the compiled module to run
    args = parser.parse_args()
    if args.run:
        run_loop(args)
        return 0
    settings = settings_of(args)
    xla = llada_jax.generate(llada_jax.load(args.model), PROMPT, loop="compiled", **OPTIONS,
                             editing_threshold=args.editing_threshold)
    expected = f"{','.join(map(str, xla.output_ids.tolist()))} {xla.nfe}"
    print(f"XLA compiled loop: {expected}")
    with tempfile.TemporaryDirectory(prefix="llada-probe-") as scratch:
        vmfb = Path(scratch) / "loop.vmfb"
        try:
            compile_loop(Path(args.model), settings, vmfb)
        except LladaError as err:
            print(f"iree-compile: {err}")
            return 1
        print("iree-compile: compiled")
        child = subprocess.run([sys.executable, "-m", "eval.iree_block_loop_probe", *sys.argv[1:], "--run", str(vmfb)],
                               capture_output=True, text=True)
    if child.returncode != 0:
        how = signal.Signals(-child.returncode).name if child.returncode < 0 else f"exit {child.returncode}"
        errors = [line for line in (child.stderr or "").splitlines() if "Error" in line]
        print(f"IREE run: failed ({how}){': ' + errors[-1] if errors else ''}")
        return 1
    print(f"IREE run: {child.stdout.strip()} ({'the same' if child.stdout.strip() == expected else 'other'} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
