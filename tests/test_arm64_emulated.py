"""The arm64 artifacts run: the same steps compiled for aarch64 execute under qemu-aarch64 with IREE's
aarch64 runtime and give the host's outputs."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from llada_jax.backends.iree import IreeBackend, Session, load_bundle
from llada_jax.cli import main
from llada_jax.model.readout import ReadoutSpec, TokenBiases
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.locations import user_cache_dir
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from lowering.bundle import compile_bundle
from lowering.emulation import QEMU, SYSROOT, emulator_available, run_module, runtime_tools_dir
from lowering.kernel_dispatch import target_compiler
from lowering.targets import target
from tests.conftest import TINY, bundle_weight_bytes, require, write_checkpoint
from tests.test_families import CONFIGS
from tests.test_llada2 import CONFIG as LLADA2

pytestmark = pytest.mark.slow  # IREE compiles or child processes: the full tier only


@pytest.fixture(scope="module")
def tools():
    require(emulator_available(), "user-mode qemu with arm64 libraries (qemu-user-static libc6-arm64-cross "
                                  "libstdc++6-arm64-cross)")
    return runtime_tools_dir(user_cache_dir("tools"))


@pytest.mark.parametrize("target", ["linux-arm64", "android-arm64"])
def test_arm64_step_under_qemu_matches_host(tiny_dir, tmp_path, tools, target):
    assert_steps_match_host(tiny_dir, TINY, target, tmp_path, tools)


FAMILIES = {**CONFIGS, "llada2": LLADA2}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_steps_under_qemu_match_host(family, tmp_path, tools):
    """Dream (QKV biases, shifted logits), LLaDA-MoE (q/k norms, routed experts) and LLaDA2 (fused q/k/v, partial
    rotary, grouped sigmoid routing, a dense first layer) on aarch64: their steps give the host's outputs (their
    compiled decode loops are refused in one line, see tests/test_families.py and tests/test_llada2.py)."""
    checkpoint = write_checkpoint(tmp_path / family, FAMILIES[family], std=0.3)
    assert_steps_match_host(checkpoint, FAMILIES[family], "linux-arm64", tmp_path, tools)


@pytest.mark.parametrize("bits, activations", [(4, "float"), (4, "int8"), (8, "int8")], ids=["w4a16", "w4a8", "w8a8"])
def test_our_kernels_in_an_arm64_bundle_under_qemu_give_the_host_outputs(tiny_dir, tmp_path, tools, bits,
                                                                         activations):
    """The kernels' arm64 path (sdot), linked into the aarch64 bundle, gives what their x86 path gives in the
    host bundle."""
    require(target_compiler(target("linux-arm64")) is not None, "a C compiler for aarch64 (gcc-aarch64-linux-gnu)")
    checkpoint = quantize_checkpoint(tiny_dir, tmp_path / "q", QuantScheme(bits, 32 if bits == 4 else None))
    arm = assert_steps_match_host(checkpoint, TINY, "linux-arm64", tmp_path, tools, activations)
    assert json.loads((arm / "manifest.json").read_text())["kernels"]["kind"] == "own"


def assert_steps_match_host(checkpoint, config, target, tmp_path, tools, activations="float"):
    """The full step and the readout of an aarch64 bundle under qemu equal the host bundle's."""
    arm = compile_bundle(checkpoint, target, tmp_path / "arm", max_len=16, window=8, activations=activations)
    host = load_bundle(compile_bundle(checkpoint, "host", tmp_path / "host", max_len=16, window=8,
                                      activations=activations))
    tokens = np.full((1, 16), config.mask_token_id, np.int32)
    tokens[0, :9] = np.arange(40, 49)
    valid = np.arange(16)[None] < 13
    zeros = np.zeros(config.embedding_size, np.float32)
    hidden, keys, _ = run_module(tools, arm / "steps.vmfb", "full_b1_s16", [tokens, valid.astype(np.int32)],
                                 [arm / "weights.irpa"], outputs=3)
    x0, logp = run_module(tools, arm / "steps.vmfb", "read_b1_s16_w16",
                          [hidden, np.arange(16, dtype=np.int32), np.array(0, np.float32), zeros, zeros],
                          [arm / "weights.irpa"], outputs=2)
    session = Session(host.path, host.manifest, "local-task")
    want = IreeBackend(host, session, ReadoutSpec(), TokenBiases.build(config.embedding_size)).full(tokens, valid)
    assert x0[:, :13].tolist() == want.readout.x0[:, :13].tolist()
    np.testing.assert_allclose(logp[:, :13], want.readout.logp[:, :13], atol=1e-4)
    np.testing.assert_allclose(keys[:, :, :13], session.read(want.keys)[:, :, :13], atol=1e-4)
    return arm


@pytest.mark.parametrize("target", ["linux-arm64", "android-arm64"])
def test_arm64_run_script_under_qemu_prints_the_host_ids(tiny_dir, tmp_path, tools, capsys, target):
    """No Python on the device: the bundle's run.sh drives IREE's aarch64 iree-run-module (here under qemu)
    through the compiled decode loop and prints what `llada generate --json` gives on the host (the Android
    vmfb links its code embedded, so the aarch64 Linux runtime runs it too)."""
    setting = ["--policy", "dual-cache+speculative", "--threshold", "0.9", "--gen-length", "16", "--block-length", "8",
               "--steps", "16"]
    assert main(["compile", "--model", str(tiny_dir), "--target", target, "--out", str(tmp_path / "arm"),
                 "--max-len", "32", "--window", "16", *setting]) == 0
    capsys.readouterr()
    command = f"{QEMU} -L {SYSROOT} {tools / 'iree-run-module'}"
    for ids in ("1,2,3", "9,8,7,6,5,4,3,2,1,0,11,12,13"):
        proc = subprocess.run([str(tmp_path / "arm" / "run.sh"), ids], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "IREE_RUN_MODULE": command})
        assert proc.returncode == 0, proc.stderr
        assert main(["generate", "--model", str(tiny_dir), "--prompt-ids", ids, "--json", *setting]) == 0
        want = json.loads(capsys.readouterr().out)["output_ids"]
        assert proc.stdout.splitlines()[-1] == ",".join(map(str, want))


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_arm64_block_loop_run_script_under_qemu_prints_the_host_bundles_ids(tmp_path, tools, streamed):
    """LLaDA2 int4 on our routed kernels (sdot on aarch64), its weights resident or streamed through a budget: the
    aarch64 bundle's run.sh drives the compiled block loop under qemu and prints what the host bundle's prints."""
    from tests.test_decode_loop_bundle import host_iree_run_module
    from tests.test_moe import int4_llada2

    require(target_compiler(target("linux-arm64")) is not None, "a C compiler for aarch64 (gcc-aarch64-linux-gnu)")
    config, checkpoint = int4_llada2(tmp_path)
    budget = ["--device-memory-budget", str(bundle_weight_bytes(checkpoint) - 1)] if streamed else []
    setting = ["--gen-length", "12", "--block-length", "8", "--activations", "int8", "--max-len", "32", *budget]
    commands = {"linux-arm64": f"{QEMU} -L {SYSROOT} {tools / 'iree-run-module'}", "host": str(host_iree_run_module())}
    for name in commands:
        assert main(["compile", "--model", str(checkpoint), "--target", name, "--out", str(tmp_path / name),
                     *setting]) == 0
        assert bool(json.loads((tmp_path / name / "manifest.json").read_text())["streamed"]) == streamed
    for ids in ("1,2,3,4,5", "7,8,9,10,11,12,13,14,15,16,17,18,19,20,21"):
        lines = []
        for name, command in commands.items():
            proc = subprocess.run([str(tmp_path / name / "run.sh"), ids], capture_output=True, text=True,
                                  timeout=600, env={**os.environ, "IREE_RUN_MODULE": command})
            assert proc.returncode == 0, proc.stderr
            lines.append(proc.stdout.splitlines()[-1])
        assert lines[0] == lines[1]
