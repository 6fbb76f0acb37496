"""Our quantized matmul kernels against the numpy statement of their arithmetic (`kernel_statement`): every ISA
path this host can build (its own flags, AVX2 without VNNI, plain C), then through XLA's FFI, then in a model."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import platform
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.kernels import activations, build
from llada_jax.kernels import xla as own_kernels
from llada_jax.kernels.build import (
    C_FLAGS,
    KERNEL_SOURCES,
    SOURCE_DIR,
    Toolchain,
    compile_object,
    find_toolchain,
    shared_library,
)
from llada_jax.quant import choice
from llada_jax.quant.choice import kernels_in_use
from llada_jax.quant.qlinear import quantized_linear, to_device
from llada_jax.quant.quantize import HostQuantized, QuantScheme, quantize_matrix
from llada_jax.system.errors import LladaError
from llada_jax.system.host_cpu import cpu_flags
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint
from lowering import kernel_dispatch
from lowering.bundle_weights import WeightLayout
from lowering.emulation import QEMU, SYSROOT, emulator_available
from lowering.kernel_dispatch import target_compiler
from lowering.targets import ARM64_KERNELS, target
from tests import kernel_statement as statement
from tests.conftest import require, require_cpu_backend


def isa_builds() -> list[tuple[str, ...]]:
    """Compiler flags giving each ISA path this host can run: its own; AVX-512 without VNNI (lanes of 8 for int8,
    of 16 for float); AVX2 with AVX-VNNI (256-bit vpdpbusd); AVX2 alone; plain C."""
    if platform.machine() in ("x86_64", "AMD64"):
        flags = cpu_flags()
        forced = [("-march=skylake-avx512",) if {"avx512f", "avx512bw", "avx512vl"} <= flags else None,
                  ("-march=x86-64-v3", "-mavxvnni") if "avx_vnni" in flags else None,
                  ("-march=x86-64-v3",) if "avx2" in flags else None]
        return [("-march=native",), *(build for build in forced if build), ("-march=x86-64",)]
    if platform.machine() in ("aarch64", "arm64"):
        return [("-march=native",), ("-march=armv8-a",)]
    return [("-march=native",)]


# Each arm64 path and the ISA it names; the last is the arm64 bundles' own build.
ARM64_BUILDS = {("-march=armv8-a",): "generic C", ("-march=armv8.2-a+dotprod",): "arm64 dotprod (sdot)",
                ARM64_KERNELS.flags: "arm64 i8mm (smmla)"}


def arm64_runner(build: tuple[str, ...], directory: Path) -> list[str]:
    """`tests/kernel_runner.c` and the kernels built for aarch64 with `build`, as a command run under qemu."""
    require(emulator_available(), "user-mode qemu with arm64 libraries (qemu-user-static libc6-arm64-cross)")
    compiler = target_compiler(target("linux-arm64"))
    require(compiler is not None, "an aarch64 C compiler (gcc-aarch64-linux-gnu)")
    assert compiler is not None
    objects = [compile_object([*compiler, *C_FLAGS, *build], SOURCE_DIR / name, directory) for name in KERNEL_SOURCES]
    runner = directory / "kernel_runner"
    subprocess.run([*compiler, "-O2", *build, "-I", str(SOURCE_DIR), str(Path(__file__).parent / "kernel_runner.c"),
                    *map(str, objects), "-o", str(runner)], check=True)
    return [QEMU, "-L", str(SYSROOT), str(runner)]


@pytest.fixture(scope="module", params=[("host", build) for build in isa_builds()] +
                [("arm64", build) for build in ARM64_BUILDS], ids=lambda param: f"{param[0]} {' '.join(param[1])}")
def kernel(request, tmp_path_factory):
    """`kernel(scheme, x, stored, scales[, signed8])` of one build: this host's through ctypes, arm64's under
    qemu."""
    cpu, build = request.param
    if cpu == "arm64":
        runner = arm64_runner(build, tmp_path_factory.mktemp("arm64"))
        return lambda *call: statement.run_program(runner, *call)[0]
    toolchain = find_toolchain()
    require(toolchain is not None, "a C compiler (gcc or clang, with c++)")
    assert toolchain is not None
    return functools.partial(statement.run, shared_library(toolchain, build))


FORCED_PATHS = {"-march=x86-64": "generic C", "-march=armv8-a": "generic C", "-march=x86-64-v3": "x86 avx2",
                "-march=skylake-avx512": "x86 avx2", "-march=x86-64-v3 -mavxvnni": "x86 avx-vnni"}


def native_path(flags: set[str]) -> str:
    """The ISA path `-march=native` must take on a CPU with `flags`."""
    for flag, path in (("avx512_vnni", "x86 avx512-vnni"), ("avx_vnni", "x86 avx-vnni"), ("avx2", "x86 avx2"),
                       ("asimddp", "arm64 dotprod")):
        if flag in flags:
            return path
    return "generic C"


@pytest.mark.parametrize("build", isa_builds(), ids=lambda flags: " ".join(flags))
def test_each_build_takes_the_isa_path_its_flags_name(build):
    toolchain = find_toolchain()
    require(toolchain is not None, "a C compiler (gcc or clang, with c++)")
    assert toolchain is not None
    lib = ctypes.CDLL(str(shared_library(toolchain, build)))
    lib.llk_isa.restype = ctypes.c_char_p
    want = FORCED_PATHS.get(" ".join(build)) or native_path(cpu_flags())
    assert lib.llk_isa().decode().startswith(want)


@pytest.mark.parametrize("build", ARM64_BUILDS, ids=lambda flags: " ".join(flags))
def test_each_arm64_build_takes_the_isa_path_its_flags_name(build, tmp_path):
    runner = arm64_runner(build, tmp_path)
    x, stored = np.ones((1, 32), np.float32), np.zeros((1, 16), np.uint8)
    assert statement.run_program(runner, "w4a8", x, stored, np.ones((1, 1), np.float32))[1] == ARM64_BUILDS[build]


def draw_problem(data, bits: int):
    """positions (some past a chunk of 64, 128, 256 or 512), rows (each call takes half: some in lanes of 16 or of
    2 x 16, some left over) and blocks of 32 columns; a scale group of whole blocks (or the whole row)."""
    positions = data.draw(st.one_of(st.integers(1, 9), st.integers(63, 67),
                                    st.sampled_from([127, 129, 255, 257, 511, 513])))
    rows, blocks = data.draw(st.one_of(st.integers(1, 40), st.integers(64, 100))), data.draw(st.integers(1, 8))
    group_blocks = data.draw(st.sampled_from(sorted({d for d in (1, 2, 4) if blocks % d == 0} | {blocks})))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal((positions, 32 * blocks)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    if data.draw(st.booleans()):
        x[:, :32] = 0  # an all-zero block: scale 0
    low = -(1 << (bits - 1))
    values = rng.integers(low, -low, (rows, 32 * blocks))
    scales = rng.uniform(1e-3, 1.0, (rows, blocks // group_blocks)).astype(np.float32)
    if data.draw(st.booleans()):
        scales = scales.astype(ml_dtypes.bfloat16)
    return x, values, scales


def assert_within_rounding(got: np.ndarray, want: np.ndarray, magnitude: np.ndarray) -> None:
    assert np.all(np.isfinite(got))
    np.testing.assert_array_less(np.abs(got - want), 1e-5 * magnitude + 1e-30)


@settings(max_examples=40)
@given(data=st.data())
def test_w4a8_is_its_statement(kernel, data):
    x, values, scales = draw_problem(data, 4)
    got = kernel("w4a8", x, statement.pack4(values), scales)
    want = statement.int8_result(x, values, scales.astype(np.float32), nibbles=True)
    assert_within_rounding(got, want, statement.int8_result(np.abs(x), np.abs(values), np.abs(scales), True))


@settings(max_examples=40)
@given(data=st.data(), signed8=st.booleans())
def test_w8a8_is_its_statement(kernel, data, signed8):
    x, values, scales = draw_problem(data, 8)
    got = kernel("w8a8", x, statement.pack8(values, signed8), scales, signed8)
    want = statement.int8_result(x, values, scales.astype(np.float32), nibbles=False)
    assert_within_rounding(got, want, statement.int8_result(np.abs(x), np.abs(values), np.abs(scales), False))


@settings(max_examples=40)
@given(data=st.data())
def test_w4a16_is_its_statement(kernel, data):
    x, values, scales = draw_problem(data, 4)
    got = kernel("w4a16", x, statement.pack4(values), scales)
    want = statement.float_result(x, values, scales.astype(np.float32))
    assert_within_rounding(got, want, statement.float_result(np.abs(x), np.abs(values), np.abs(scales)))


@pytest.fixture(scope="module")
def arm64_bundle_kernel(tmp_path_factory):
    """The arm64 bundles' build of the kernels, under qemu."""
    runner = arm64_runner(ARM64_KERNELS.flags, tmp_path_factory.mktemp("arm64-bundle"))
    return lambda *call: statement.run_program(runner, *call)[0]


@settings(max_examples=10)
@given(data=st.data())
def test_w4a16_rows_in_lanes_give_the_same_bits_on_x86_and_arm64(arm64_bundle_kernel, data):
    """Rows in float lanes sum each output in one FMA chain in column order on every ISA, so an arm64 bundle's
    W4A16 products equal the x86 host's bit for bit (each call's rows whole lanes of 32, 16 and 8)."""
    require("avx2" in cpu_flags() and find_toolchain() is not None, "an x86 host with AVX2 and a C compiler")
    x, values, scales = draw_problem(data, 4)
    rows = 64 * data.draw(st.integers(1, 2))  # kernel calls take half each
    values, scales = np.resize(values, (rows, values.shape[1])), np.resize(scales, (rows, scales.shape[1]))
    host = statement.run(shared_library(find_toolchain(), ("-march=native",)), "w4a16", x,
                         statement.pack4(values), scales)
    np.testing.assert_array_equal(arm64_bundle_kernel("w4a16", x, statement.pack4(values), scales), host)


@settings(max_examples=30)
@given(data=st.data(), nibbles=st.booleans(), feature_major=st.booleans())
def test_the_step_prepares_activations_exactly_as_stated(data, nibbles, feature_major):
    """Our preparation (`c/activations.c`) from either layout, bit for bit the statement's, block-major."""
    kernels_on_xla()
    x, _, _ = draw_problem(data, 4)
    held = jnp.asarray(x.T.copy() if feature_major else x)
    got = jax.jit(lambda h: activations.quantized(h, nibbles, feature_major))(held)
    for a, b in zip(got, statement.quantize_activations(x, nibbles)):
        np.testing.assert_array_equal(np.asarray(a).swapaxes(0, 1), b)
    ordered = jax.jit(lambda h: activations.float_blocks(h, feature_major))(held)
    np.testing.assert_array_equal(np.asarray(ordered).swapaxes(0, 1), statement.block_order(x, True))


@pytest.mark.parametrize("bits, scheme", [(4, "w4a8"), (8, "w8a8")])
def test_int32_block_sums_are_exact(kernel, bits, scheme):
    """Integer activations with a 127 in every block quantize to themselves (scale 1): with unit weight scales
    the float result is the exact integer sum."""
    rng = np.random.default_rng(bits)
    x = rng.integers(-127, 128, (7, 256)).astype(np.float32)
    x[:, ::32] = 127
    low = -(1 << (bits - 1))
    values = rng.integers(low, -low, (37, 256))
    values[0] = low  # the extreme weight everywhere on one row
    stored = statement.pack4(values) if bits == 4 else statement.pack8(values, False)
    got = kernel(scheme, x, stored, np.ones((37, 2), np.float32))
    want = statement.block_sums(x.reshape(7, -1, 32).astype(np.int8) if bits == 8 else
                                statement.block_order(x, True).astype(np.int8), values, bits == 4).sum(-1)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def kernels_on_xla() -> str:
    require_cpu_backend("running our kernels through XLA")
    require(find_toolchain() is not None, "a C compiler (gcc or clang, with c++)")
    isa = own_kernels.available()
    assert isa, "the kernels did not build"
    return isa


@pytest.mark.parametrize("scheme, bits", [("w4a8", 4), ("w4a16", 4), ("w8a8", 8)])
@pytest.mark.parametrize("scale_dtype", [np.float32, ml_dtypes.bfloat16])
def test_the_xla_custom_call_is_the_statement(scheme, bits, scale_dtype):
    kernels_on_xla()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((37, 96)).astype(np.float32)  # positions not a multiple of the tile
    low = -(1 << (bits - 1))
    values = rng.integers(low, -low, (70, 96))
    scales = rng.uniform(0.01, 1, (70, 3 if bits == 4 else 1)).astype(scale_dtype)
    stored = statement.pack4(values) if bits == 4 else statement.pack8(values, False)
    got = np.asarray(own_kernels.matmul(jnp.asarray(x), jnp.asarray(stored), jnp.asarray(scales), scheme))
    s32 = scales.astype(np.float32)
    want = (statement.float_result(x, values, s32) if scheme == "w4a16"
            else statement.int8_result(x, values, s32, nibbles=bits == 4))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("columns", [False, True])
def test_a_w4a16_linear_equals_xla_code(columns):
    kernels_on_xla()
    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    host = HostQuantized.of(*quantize_matrix(w, QuantScheme(4, 32)), QuantScheme(4, 32))
    x = jnp.asarray(rng.standard_normal((128, 9) if columns else (2, 9, 128)).astype(np.float32))
    own = quantized_linear(x, to_device(host, kernels="own"), columns)
    theirs = quantized_linear(x, to_device(host), columns)
    np.testing.assert_allclose(np.asarray(own), np.asarray(theirs), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def int4_dir(tiny_dir, tmp_path_factory):
    return quantize_checkpoint(tiny_dir, tmp_path_factory.mktemp("kernels") / "q4", QuantScheme(4, 32))


def test_a_model_with_our_w4a16_kernels_generates_xla_tokens(int4_dir):
    kernels_on_xla()
    own = llada_jax.load(int4_dir)
    theirs = llada_jax.load(int4_dir, kernels="compiler")
    assert own.kernels == "own" and own.params["blocks"][0]["q_proj"].kernel == "w4a16"
    ids = np.arange(3, 27)[None]
    np.testing.assert_allclose(llada_jax.logits(own, ids), llada_jax.logits(theirs, ids), rtol=1e-4, atol=1e-4)
    prompt = [5, 9, 11, 4]
    options = dict(gen_length=16, block_length=16, steps=8)
    assert (llada_jax.generate(own, prompt, **options).output_ids.tolist()
            == llada_jax.generate(theirs, prompt, **options).output_ids.tolist())


def test_without_a_compiler_the_compilers_code_runs_after_one_line(monkeypatch, capsys, tmp_path):
    """No C compiler: `llada_jax.load` and `llada compile` say so in one line each and run XLA's / IREE's code."""
    require_cpu_backend("choosing our kernels")
    monkeypatch.setattr(own_kernels, "load", lambda: (_ for _ in ()).throw(LladaError("no C compiler (cc) on PATH")))
    monkeypatch.setattr(own_kernels, "_note_once", functools.cache(own_kernels._note_once.__wrapped__))
    assert kernels_in_use("own", {"m.blocks.0.q_proj": QuantScheme(4, 32)}) == "compiler"
    assert kernels_in_use("own", {"m.blocks.0.q_proj": QuantScheme(4, 32)}) == "compiler"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C compiler" in err and "XLA's code" in err
    monkeypatch.setattr(kernel_dispatch.shutil, "which", lambda name: None)
    layout = WeightLayout((), {"m.blocks.0.q_proj": QuantScheme(4, 32)})
    assert kernel_dispatch.kernel_compiler(target("linux-arm64"), layout, "own") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "aarch64-linux-gnu-gcc" in err and "IREE's code" in err
    assert kernel_dispatch.kernel_compiler(target("vulkan"), layout, "own") is None  # a GPU: IREE's code, no note
    assert capsys.readouterr().err == ""


def test_a_failed_build_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("LLADA_CACHE", str(tmp_path))
    with pytest.raises(LladaError) as error:
        shared_library(Toolchain("false", "false"), ("-march=native",))
    assert str(error.value).startswith("building the kernels failed (false)") and "\n" not in str(error.value)
    assert all(path.is_dir() for path in tmp_path.rglob("*")) and not list(tmp_path.rglob(".*"))  # no scratch


def test_host_kernel_flags_need_the_instructions_they_enable(monkeypatch):
    """$LLADA_KERNELS_ARCH may pick an older ISA path, never one this CPU cannot run (it would die of SIGILL):
    such flags are refused in one line, on XLA's path and for host bundles; -march=native always passes."""
    toolchain = find_toolchain()
    require(toolchain is not None, "a C compiler (gcc or clang, with c++)")
    assert toolchain is not None
    x86 = platform.machine() in ("x86_64", "AMD64")
    arch = ("-march=x86-64-v3",) if x86 else ("-march=armv8.2-a+dotprod",)
    with pytest.raises(LladaError, match=r"^LLADA_KERNELS_ARCH=\S+ enables (avx2, fma|asimddp), which this CPU lacks$"):
        build.check_runs_here(toolchain.cc, arch, flags=set())
    build.check_runs_here(toolchain.cc, ("-march=native",), flags=set())
    monkeypatch.setenv("LLADA_KERNELS_ARCH", " ".join(arch))
    assert build.host_arch() == arch
    monkeypatch.setattr(build, "cpu_flags", lambda: set())
    with pytest.raises(LladaError, match="which this CPU lacks"):
        build.xla_library(toolchain, Path(jax.ffi.include_dir()))
    with pytest.raises(LladaError, match="which this CPU lacks"):
        kernel_dispatch.target_objects(dataclasses.replace(target("host"), kernels=dataclasses.replace(
            target("host").kernels, flags=arch)), [toolchain.cc], Path("/nonexistent"))


def test_bf16_steps_keep_xla_bf16_matmuls_where_the_cpu_has_them(monkeypatch):
    """Float activations in bfloat16 steps run XLA's bf16 matmuls on a CPU with bf16 dot products (faster than our
    float32 W4A16 there); int8 activations and float32 steps run our kernels."""
    kernels_on_xla()
    quantized = {"m.blocks.0.q_proj": QuantScheme(4, 32)}
    monkeypatch.setattr(choice, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert kernels_in_use("own", quantized, None, "float", "bfloat16") == "compiler"
    assert kernels_in_use("own", quantized, None, "int8", "bfloat16") == "own"
    assert kernels_in_use("own", quantized, None, "float", "float32") == "own"
    monkeypatch.setattr(choice, "cpu_flags", lambda: {"avx2"})
    assert kernels_in_use("own", quantized, None, "float", "bfloat16") == "own"


def test_another_backend_runs_xlas_code_without_a_note(monkeypatch, capsys):
    """On a GPU (any backend but the CPU) quantized matmuls are XLA's code: our kernels are CPU code."""
    monkeypatch.setattr(choice.jax, "default_backend", lambda: "gpu")
    assert kernels_in_use("own", {"m.blocks.0.q_proj": QuantScheme(4, 32)}, None, "int8") == "compiler"
    assert capsys.readouterr().err == ""
