"""Building the kernels with the system's C compiler, once per machine and source: a shared library in the user's
cache, keyed by the sources, the compiler, its flags and the CPU's flags (`-march=native` picks the ISA path)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from llada_jax.system.atomic import scratch_dir
from llada_jax.system.errors import LladaError
from llada_jax.system.host_cpu import cpu_flags
from llada_jax.system.locations import user_cache_dir

SOURCE_DIR = Path(__file__).resolve().parent / "c"
KERNEL_SOURCES = ("activations.c", "w4a8.c", "w4a16.c", "w8a8.c", "routed.c")
HEADERS = ("kernels.h", "simd.h", "stored_blocks.h", "int8_matmul.h", "row_lanes.h", "pair_tiles.h")
XLA_SHIM = "xla_ffi.cc"
# Freestanding C (no libc: the same files link into IREE's executables); strict IEEE float (no contraction
# across the statements the numpy statement of each kernel follows).
C_FLAGS = ("-O3", "-std=c11", "-fPIC", "-ffreestanding", "-fno-math-errno", "-Wall")
CXX_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-Wall")
ARCH_VARIABLE = "LLADA_KERNELS_ARCH"


def host_arch() -> tuple[str, ...]:
    """The flags that pick this host's ISA path: `-march=native`, or $LLADA_KERNELS_ARCH (e.g. `-march=x86-64-v3`:
    the AVX2 path on a newer CPU, to measure or check what an older one runs)."""
    return tuple(os.environ.get(ARCH_VARIABLE, "").split()) or ("-march=native",)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    cc: str
    cxx: str

    def version(self) -> str:
        return subprocess.run([self.cc, "--version"], capture_output=True, text=True, check=False).stdout


def find_toolchain() -> Toolchain | None:
    """$CC / $CXX, else the first of cc, gcc, clang (c++, g++, clang++) on PATH; None without both."""
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    return Toolchain(cc, cxx) if cc and cxx else None


# The compilers' macros for instruction sets the kernels or the compiler's own code may use, and the CPU flag
# (/proc/cpuinfo) each needs.
FEATURE_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw",
                  "__AVX512VL__": "avx512vl", "__AVX512VNNI__": "avx512_vnni", "__AVXVNNI__": "avx_vnni",
                  "__AVX512BF16__": "avx512_bf16", "__AMX_TILE__": "amx_tile", "__ARM_FEATURE_DOTPROD": "asimddp",
                  "__ARM_FEATURE_MATMUL_INT8": "i8mm"}


def check_runs_here(cc: str, arch: tuple[str, ...], flags: set[str] | None = None) -> None:
    """Refuse host flags that enable instructions this CPU lacks (its kernels would die of SIGILL): only
    $LLADA_KERNELS_ARCH can ask for them. Flags the compiler rejects are left to the build's own error."""
    if arch == ("-march=native",):
        return
    done = subprocess.run([cc, *arch, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                          check=False)
    have = cpu_flags() if flags is None else flags
    missing = sorted({flag for macro, flag in FEATURE_MACROS.items()
                      if f"#define {macro} " in done.stdout and flag not in have})
    if missing:
        raise LladaError(f"{ARCH_VARIABLE}={' '.join(arch)} enables {', '.join(missing)}, which this CPU lacks")


def xla_library(toolchain: Toolchain, include_dir: Path) -> Path:
    """The XLA plugin (`xla_ffi.cc` + the kernels) for this host, built on first use."""
    check_runs_here(toolchain.cc, host_arch())
    return shared_library(toolchain, host_arch(), include_dir)


def shared_library(toolchain: Toolchain, arch: tuple[str, ...], xla_include_dir: Path | None = None) -> Path:
    """The kernels built with `arch` flags as a shared library in the cache (with the XLA shim when given
    XLA's FFI headers), built on first use."""
    names = (*KERNEL_SOURCES, *HEADERS) + ((XLA_SHIM,) if xla_include_dir else ())
    key = _key([SOURCE_DIR / name for name in names], toolchain.version(), arch, str(xla_include_dir),
               " ".join(sorted(cpu_flags())))
    out = user_cache_dir("kernels") / key / "libllada_kernels.so"
    if not out.is_file():
        _build_shared(toolchain, arch, xla_include_dir, out)
    return out


def _key(sources: list[Path], *facts: object) -> str:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(repr(facts).encode())
    return digest.hexdigest()[:16]


def _build_shared(toolchain: Toolchain, arch: tuple[str, ...], xla_include_dir: Path | None, out: Path) -> None:
    with scratch_dir(out, "build-kernels") as scratch:
        objects = [compile_object([toolchain.cc, *C_FLAGS, *arch], SOURCE_DIR / name, scratch)
                   for name in KERNEL_SOURCES]
        if xla_include_dir:
            objects.append(compile_object([toolchain.cxx, *CXX_FLAGS, *arch, f"-I{xla_include_dir}"],
                                          SOURCE_DIR / XLA_SHIM, scratch))
        linked = scratch / out.name
        _run([toolchain.cxx, "-shared", "-o", str(linked), *map(str, objects)])
        os.replace(linked, out)  # atomic: a reader sees no library or a whole one


def compile_object(command: list[str], source: Path, directory: Path) -> Path:
    """`source` compiled by `command` (a compiler and its flags) into an object file in `directory`."""
    obj = directory / (source.stem + ".o")
    _run([*command, "-I", str(SOURCE_DIR), "-c", str(source), "-o", str(obj)])
    return obj


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:200])
        raise LladaError(f"building the kernels failed ({Path(command[0]).name}): {first}")
