#!/usr/bin/env bash
# System packages some tests need, from Debian's archive (run as root, or with sudo):
# - Mesa's software Vulkan driver: the IREE vulkan target runs on llvmpipe/lavapipe;
# - user-mode qemu with arm64 libraries: the arm64 artifacts run under emulation;
# - bubblewrap: the HumanEval sandbox's private filesystem view;
# - C compilers for our quantized matmul kernels: the host's (gcc, g++) and aarch64's with its C library (arm64
#   bundles; the kernels' own tests under qemu).
# Without them those tests skip with the reason (and fail under CI=true, which runs this first).
set -euo pipefail
SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
$SUDO apt-get update -q
$SUDO apt-get install -y -q mesa-vulkan-drivers libvulkan1 qemu-user-static libc6-arm64-cross \
    libstdc++6-arm64-cross libc6-dev-arm64-cross bubblewrap gcc g++ gcc-aarch64-linux-gnu
