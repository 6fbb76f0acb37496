"""Run an aarch64 vmfb on this x86 machine: IREE's aarch64 `iree-run-module` under `qemu-aarch64`.

This is how we prove the arm64 artifacts run without a phone: the same step compiled for aarch64
(Linux or Android triple, embedded linking) executes under user-mode emulation, and its outputs are
compared with the host's. Needs Debian's qemu-user-static and libc6-arm64-cross, plus IREE's aarch64
runtime wheel (fetched from PyPI once into the cache).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from llada_jax.system.atomic import atomic_dir, write_once
from llada_jax.system.errors import LladaError

QEMU = "qemu-aarch64-static"
SYSROOT = Path("/usr/aarch64-linux-gnu")


def runtime_tools_dir(cache: Path) -> Path:
    """IREE's aarch64 runtime tools for the installed IREE version, downloaded on first use."""
    from importlib.metadata import version

    iree = version("iree-base-runtime")
    tools = cache / f"iree-runtime-aarch64-{iree}"
    return write_once(tools, lambda tools: (tools / "iree-run-module").is_file(), lambda: _download_tools(iree, tools))


def _download_tools(iree: str, tools: Path) -> None:
    with tempfile.TemporaryDirectory() as download, atomic_dir(tools, "download-runtime-tools") as staging:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_28_aarch64",
                        "--dest", download, f"iree-base-runtime=={iree}"], check=True, capture_output=True)
        wheel = next(Path(download).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith("iree/_runtime_libs/iree-"):
                    target = staging / Path(name).name
                    target.write_bytes(archive.read(name))
                    target.chmod(0o755)


def emulator_available() -> bool:
    return shutil.which(QEMU) is not None and (SYSROOT / "lib").is_dir()


def check_emulator() -> None:
    if not emulator_available():
        raise LladaError(f"arm64 emulation needs {QEMU} and {SYSROOT} "
                         "(apt-get install qemu-user-static libc6-arm64-cross libstdc++6-arm64-cross)")


def run_module(tools: Path, vmfb: Path, function: str, inputs: list[np.ndarray], parameters: list[Path],
               outputs: int) -> list[np.ndarray]:
    """Invoke `function` of an aarch64 vmfb under qemu; inputs and outputs pass through .npy files."""
    check_emulator()
    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        command = [QEMU, "-L", str(SYSROOT), str(tools / "iree-run-module"), f"--module={vmfb}",
                   "--device=local-task", f"--function={function}"]
        command += [f"--parameters=model={p}" for p in parameters]
        for i, array in enumerate(inputs):
            np.save(work_dir / f"in{i}.npy", array)
            command.append(f"--input=@{work_dir / f'in{i}.npy'}")
        command += [f"--output=@{work_dir / f'out{i}.npy'}" for i in range(outputs)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise LladaError(f"iree-run-module under qemu failed: {proc.stderr.strip().splitlines()[-1:]}")
        return [np.load(work_dir / f"out{i}.npy") for i in range(outputs)]
