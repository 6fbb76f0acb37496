"""Named compile targets and the IREE flags that worked on these machines (see the toolchain notes).
Names are validated here, before iree-compile ever sees them (an unknown Vulkan target crashes it)."""

from __future__ import annotations

import dataclasses
import platform

from llada_jax.kernels.build import host_arch
from llada_jax.model.layout import IREE_CPU_LAYOUT, POSITION_MAJOR, LayoutRule
from llada_jax.system.errors import LladaError
from lowering.matmul_tiles import Tiles, host_tiles


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    driver: str                 # IREE runtime driver that runs it
    flags: tuple[str, ...]
    note: str = ""
    tunes_matmuls: bool = False  # float32 matmul tiles for the host's vectors (`lowering.matmul_tiles`)
    kernels: KernelBuild | None = None  # how our kernels are built for it (None: a GPU; IREE's code)

    def layout_rule(self, data_tiling: bool) -> LayoutRule:
        """Activation layouts (`llada_jax.model.layout`): feature-major at every width for IREE's CPU code generation,
        position-major with data tiling (the form it was measured faster in) and on Vulkan (Mesa's lavapipe
        miscomputed the feature-major norm)."""
        if self.driver != "local-task" or data_tiling:
            return POSITION_MAJOR
        return IREE_CPU_LAYOUT


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """Our kernels' object files for a CPU target (`lowering.kernel_dispatch`): which C compilers can build
    them (the first found on PATH; None: the host's own), with which flags, for which IREE executable format."""
    compilers: tuple[str, ...] | None
    flags: tuple[str, ...]
    object_format: str


HOST_FORMAT = {"x86_64": "embedded-elf-x86_64", "AMD64": "embedded-elf-x86_64", "aarch64": "embedded-elf-arm_64",
               "arm64": "embedded-elf-arm_64"}.get(platform.machine(), "")
# The arm64 targets' features (+dotprod, +i8mm), for the kernels: Debian's cross gcc, or clang for aarch64.
ARM64_KERNELS = KernelBuild(("aarch64-linux-gnu-gcc", "clang --target=aarch64-linux-gnu"),
                            ("-march=armv8.2-a+dotprod+i8mm",), "embedded-elf-arm_64")


def _cpu(*flags: str) -> tuple[str, ...]:
    return ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu", *flags)


def _vulkan(target: str) -> tuple[str, ...]:
    return ("--iree-hal-target-device=vulkan", f"--iree-vulkan-target={target}")


ANDROID_ARM64 = ("--iree-llvmcpu-target-triple=aarch64-none-linux-android34",
                 "--iree-llvmcpu-target-cpu-features=+dotprod,+i8mm")

TARGETS = {
    # Transposes stay where the step puts them: propagated into a matmul, the read step's transpose of its
    # hidden rows made the LM head `W @ h.T`, which IREE ran at 150 against 200 GFLOP/s for `W @ h`.
    "host": Target("host", "local-task", _cpu("--iree-llvmcpu-target-cpu=host",
                                               "--iree-global-opt-propagate-transposes=false"), tunes_matmuls=True,
                   kernels=KernelBuild(None, host_arch(), HOST_FORMAT) if HOST_FORMAT else None),
    "vulkan": Target("vulkan", "vulkan", _vulkan("llvmpipe"), "Mesa llvmpipe/lavapipe software Vulkan"),
    "android-arm64": Target("android-arm64", "local-task", _cpu(*ANDROID_ARM64),
                            "aarch64 Android CPU with dotprod/i8mm", kernels=ARM64_KERNELS),
    "linux-arm64": Target("linux-arm64", "local-task",
                          _cpu("--iree-llvmcpu-target-triple=aarch64-unknown-linux-gnu",
                               "--iree-llvmcpu-target-cpu-features=+dotprod,+i8mm"),
                          "aarch64 Linux CPU with the Android target's features (runs under qemu-aarch64)",
                          kernels=ARM64_KERNELS),
    "android-adreno": Target("android-adreno", "vulkan", _vulkan("adreno"),
                             "Qualcomm Adreno GPU; compile-only here (wrong results on lavapipe)"),
    "android-mali": Target("android-mali", "vulkan", _vulkan("valhall"),
                           "Arm Mali (Valhall) GPU; compile-only here (wrong results on lavapipe)"),
}


# IREE's data tiling: matmul operands re-laid into the tiles its CPU kernels read. Resident weights are re-laid
# once (a second copy of them stays in device memory); weights a program streams in (`lowering.stage_ring`), like
# weights passed as arguments, would be re-laid on every call (the toolchain notes).
DATA_TILING = ("--iree-opt-data-tiling",)
# A decode loop's command buffers record direct bindings: with IREE 3.13's indirect ones, a loop body's
# dispatch referenced a binding slot beyond its command buffer's declared capacity ("indirect buffer reference
# slot 0 is out of range") at some canvas sizes, on every CPU driver. No cost measured on the loop.
DIRECT_BINDINGS = ("--iree-hal-indirect-command-buffers=false",)


def compile_flags(tgt: Target, data_tiling: bool, streamed: bool, loops: bool) -> tuple[str, ...]:
    """The target's flags, with data tiling when asked for and possible (`loops`: the module holds decode loops)."""
    flags = tgt.flags + (DIRECT_BINDINGS if loops else ())
    if not data_tiling:
        return flags
    if "--iree-hal-local-target-device-backends=llvm-cpu" not in tgt.flags:
        raise LladaError(f"--data-tiling is for CPU targets; {tgt.name} is not one")
    if streamed:
        raise LladaError("--data-tiling needs resident weights: with a device memory budget the program streams "
                         "them in and would re-lay them on every call (drop one of the two)")
    return flags + DATA_TILING


def target_tiles(tgt: Target, data_tiling: bool) -> Tiles | None:
    """The host's matmul tiles, on a target that takes them, compiled on a host with AVX-512 or AVX2, without
    data tiling (whose matmuls are IREE's own tiled kernels)."""
    return host_tiles() if tgt.tunes_matmuls and not data_tiling else None


def target(name: str) -> Target:
    if name not in TARGETS:
        raise LladaError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]
