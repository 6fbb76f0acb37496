"""The compiled decode loop inside IREE bundles: the same generation as the bundle's host loop for every
covered setting, and run.sh (IREE's own iree-run-module, no Python) printing the ids the host generates."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llada_jax.backends.select import open_bundle
from llada_jax.bundle_runner import generate_with_bundle
from llada_jax.cli import main
from llada_jax.system.errors import LladaError
from lowering.bundle import compile_bundle
from lowering.export import canvas_sizes
from policies.compiled_loop import baked_loops
from tests.conftest import TINY, require, vulkan_available

pytestmark = pytest.mark.slow  # IREE compiles or child processes: the full tier only

MAX_LEN, GEN, BLOCK = 32, 16, 8
SETTINGS = [("vanilla", None, 8), ("prefix-cache", 0.3, 16), ("dual-cache", None, 8),
            ("dual-cache+speculative:1:0.3", 0.5, 16), ("vanilla+speculative:1:0.3", None, 8),
            ("prefix-cache+speculative:1:0.4", None, 16)]


def host_iree_run_module() -> Path:
    from iree import _runtime_libs

    return Path(_runtime_libs.__file__).parent / "iree-run-module"


@pytest.fixture(scope="module")
def loop_bundle(tiny_dir, tmp_path_factory):
    loops = tuple(baked_loops(policy, threshold, GEN, BLOCK, steps, canvas_sizes(MAX_LEN))
                  for policy, threshold, steps in SETTINGS)
    path = compile_bundle(tiny_dir, "host", tmp_path_factory.mktemp("loops") / "host", max_len=MAX_LEN, window=16,
                          loops=loops)
    return path, open_bundle(path)


@settings(max_examples=15)
@given(setting=st.sampled_from(SETTINGS), prompt_len=st.integers(1, MAX_LEN - GEN), seed=st.integers(0, 10_000))
def test_bundle_loop_equals_the_bundle_host_loop(loop_bundle, setting, prompt_len, seed):
    policy, threshold, steps = setting
    ids = np.random.default_rng(seed).integers(0, TINY.mask_token_id, prompt_len)
    options = dict(gen_length=GEN, block_length=BLOCK, steps=steps, policy=policy, threshold=threshold)
    host = generate_with_bundle(loop_bundle[1], ids, loop="host", **options)
    compiled = generate_with_bundle(loop_bundle[1], ids, loop="compiled", **options)
    assert compiled.stats["loop"] == "compiled" and compiled.stats["step_call_seconds"] > 0
    assert compiled.output_ids.tolist() == host.output_ids.tolist() and compiled.nfe == host.nfe
    assert ([dataclasses.replace(r, confidence=()) for r in compiled.trace]
            == [dataclasses.replace(r, confidence=()) for r in host.trace])


def run_script(bundle: Path, ids: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bundle / "run.sh"), ids], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "IREE_RUN_MODULE": command})


def host_ids(capsys, tiny_dir, ids: str, policy: str, steps: int) -> list[int]:
    args = ["generate", "--model", str(tiny_dir), "--prompt-ids", ids, "--json", "--gen-length", str(GEN),
            "--block-length", str(BLOCK), "--steps", str(steps), "--policy", policy]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["output_ids"]


def test_run_script_prints_the_ids_the_host_generates(loop_bundle, tiny_dir, capsys):
    policy, _, steps = SETTINGS[0]  # run.sh runs the bundle's first setting
    for ids in ("1,2,3", "7", ",".join(str(i) for i in range(40, 56))):
        proc = run_script(loop_bundle[0], ids, str(host_iree_run_module()))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == ",".join(map(str, host_ids(capsys, tiny_dir, ids, policy, steps)))


@pytest.mark.parametrize("ids, message", [
    ("", "comma-separated non-negative integers"), ("1,,2", "comma-separated"), ("1,x", "comma-separated"),
    ("-1", "comma-separated"), (f"1,{TINY.embedding_size}", "outside the vocabulary"),
    (f"{TINY.mask_token_id}", "mask token id"), (",".join(["3"] * (MAX_LEN - GEN + 1)), "longest canvas (32)"),
    ("99999999999999999999", "outside the vocabulary"),
    (",".join(["3"] * 20000), "prompt (20000) + gen_length (16) = 20016 exceeds the bundle's longest canvas (32)"),
])
def test_run_script_refuses_bad_ids_in_one_line(loop_bundle, ids, message):
    proc = run_script(loop_bundle[0], ids, str(host_iree_run_module()))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("run.sh: error: ") and message in proc.stderr and proc.stderr.count("\n") == 1


def test_run_script_names_a_missing_iree_run_module(loop_bundle):
    proc = run_script(loop_bundle[0], "1,2", "/nonexistent/iree-run-module")
    assert proc.returncode == 1 and "iree-run-module failed" in proc.stderr.splitlines()[-1]


def test_run_script_names_a_command_that_prints_no_results(loop_bundle):
    proc = run_script(loop_bundle[0], "1,2", "true")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "run.sh: error: iree-run-module printed no results (is IREE_RUN_MODULE iree-run-module?)\n"


def test_run_script_called_through_links_finds_its_bundle(loop_bundle, tiny_dir, tmp_path, capsys):
    """A link on the PATH to run.sh (here a relative link to an absolute one) runs the linked bundle."""
    policy, _, steps = SETTINGS[0]
    (tmp_path / "bin").mkdir()
    (tmp_path / "absolute").symlink_to(loop_bundle[0] / "run.sh")
    (tmp_path / "bin" / "llada-run").symlink_to(Path("..") / "absolute")
    proc = subprocess.run([str(tmp_path / "bin" / "llada-run"), "1,2,3"], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env={**os.environ, "IREE_RUN_MODULE": str(host_iree_run_module())})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ",".join(map(str, host_ids(capsys, tiny_dir, "1,2,3", policy, steps)))


def test_run_script_takes_a_tool_path_with_spaces_and_a_command_with_arguments(loop_bundle, tiny_dir, tmp_path, capsys):
    """IREE_RUN_MODULE naming a tool file is that file, spaces and all; otherwise a command with arguments (here
    `env` in front of the tool, as an emulator would be)."""
    policy, _, steps = SETTINGS[0]
    want = ",".join(map(str, host_ids(capsys, tiny_dir, "1,2,3", policy, steps)))
    (tmp_path / "my tools").mkdir()
    (tmp_path / "my tools" / "iree-run-module").symlink_to(host_iree_run_module())
    for command in (str(tmp_path / "my tools" / "iree-run-module"), f"env {host_iree_run_module()}"):
        proc = run_script(loop_bundle[0], "1,2,3", command)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == want


def test_vulkan_bundle_runs_its_loop_through_run_script(tiny_dir, tmp_path, capsys):
    """GPU bundles carry the compiled loop too (Mesa's lavapipe here), run by run.sh in a process of its own."""
    require(vulkan_available(), "a Vulkan driver (Mesa's mesa-vulkan-drivers and libvulkan1)")
    policy, steps = "dual-cache+speculative:1:0.3", 8
    loops = (baked_loops(policy, None, GEN, BLOCK, steps, canvas_sizes(MAX_LEN)),)
    path = compile_bundle(tiny_dir, "vulkan", tmp_path / "vk", max_len=MAX_LEN, window=16, loops=loops)
    ids = ",".join(str(i) for i in range(40, 51))
    proc = run_script(path, ids, str(host_iree_run_module()))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ",".join(map(str, host_ids(capsys, tiny_dir, ids, policy, steps)))


def test_run_script_of_linked_weights_quotes_the_users_path(tiny_dir, tmp_path, capsys, monkeypatch):
    """A model folder whose name holds shell syntax: run.sh reads the weights there and runs none of it, from
    any directory and with CDPATH set."""
    model = tmp_path / "it's $(touch PWNED) `touch PWNED2`"
    shutil.copytree(tiny_dir, model)
    policy, threshold, steps = SETTINGS[0]
    loops = (baked_loops(policy, threshold, GEN, BLOCK, steps, canvas_sizes(MAX_LEN)),)
    bundle = compile_bundle(model, "host", tmp_path / "linked", max_len=MAX_LEN, window=16, loops=loops,
                            copy_weights=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([str(bundle / "run.sh"), "1,2,3"], capture_output=True, text=True, timeout=600, cwd=elsewhere,
                          env={**os.environ, "IREE_RUN_MODULE": str(host_iree_run_module()), "CDPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ",".join(map(str, host_ids(capsys, tiny_dir, "1,2,3", policy, steps)))
    assert not list(tmp_path.rglob("PWNED*"))
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten since
    with pytest.raises(LladaError, match="the linked weights .* changed since the bundle was compiled"):
        open_bundle(bundle)
