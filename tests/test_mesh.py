"""Many devices: `--mesh` specs, and the sharded model's properties on 4 simulated devices (run in a child
process: JAX fixes its device count when it starts, and this process has one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llada_jax.model.mesh import MeshSpec
from llada_jax.system.errors import LladaError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("text", "spec"), [
    ("data=4", MeshSpec(4, 1)), ("data=all", MeshSpec(None, 1)), ("model=2", MeshSpec(None, 2)),
    ("data=2,model=2", MeshSpec(2, 2)), ("model=2, data=all", MeshSpec(None, 2)),
])
def test_mesh_specs(text, spec):
    assert MeshSpec.parse(text) == spec


@pytest.mark.parametrize("text", ["", "data", "data=4,data=2", "model=all", "data=0", "pipeline=2", "data=-1",
                                  "data=2;model=2"])
def test_bad_mesh_specs_are_one_line_errors(text):
    with pytest.raises(LladaError) as raised:
        MeshSpec.parse(text)
    assert "\n" not in str(raised.value)


def test_one_device_mesh_is_all_this_host_has():
    assert MeshSpec.parse("data=all").build().devices.size == 1
    with pytest.raises(LladaError, match="needs 2 devices; this host has 1"):
        MeshSpec.parse("data=2").build()


@pytest.mark.slow
def test_on_four_devices_a_sharded_model_decodes_as_one_device():
    """tests/mesh_properties.py under 4 simulated devices: every row of any batch, for every policy and mesh
    shape, gives the tokens and forward passes of one device; weights and rows split as the mesh says."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mesh_properties.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
