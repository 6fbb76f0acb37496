"""The host's matmul tiles: which CPUs and products get them, and that a tuned module computes bit for bit what
an untuned one does (the tiles split M and N and add the sum over K in its order), with either ISA's tiles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import export

from llada_jax.model.layout import IREE_CPU_LAYOUT, POSITION_MAJOR
from lowering import bundle_cache, targets
from lowering.bundle import _compile_commands, compile_module
from lowering.matmul_tiles import AVX2_TILES, AVX512_TILES, Tiles, host_tiles, tunable_matmuls, tuning_spec
from lowering.targets import TARGETS, target_tiles

pytestmark = pytest.mark.slow  # IREE compiles or child processes: the full tier only


def exported(fn, *args) -> str:
    return export.export(jax.jit(fn))(*args).mlir_module()


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_only_float32_matmuls_the_register_block_divides_are_tuned():
    def products(w, h, odd, narrow, wb, hb, q, k):
        return (w @ h, odd @ h, w @ narrow, wb @ hb, jnp.einsum("bqd,btd->bqt", q, k))

    text = exported(products, f32(24, 40), f32(40, 64), f32(20, 40), f32(40, 16),
                    jax.ShapeDtypeStruct((24, 40), jnp.bfloat16), jax.ShapeDtypeStruct((40, 64), jnp.bfloat16),
                    f32(2, 32, 8), f32(2, 32, 8))
    assert tunable_matmuls(text, AVX512_TILES) == [(24, 40, 64)]               # 8 x 32 divides only w @ h
    assert tunable_matmuls(text, AVX2_TILES) == [(20, 40, 64), (24, 40, 16), (24, 40, 64)]  # 4 x 16


def test_the_tiles_follow_the_cpu_flags(tmp_path):
    def cpu(flags: str):
        path = tmp_path / flags.replace(" ", "_")
        path.write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: avx512f\n")
        return host_tiles(path)

    assert cpu("fpu sse2 avx2 fma avx512f avx512bw") == AVX512_TILES
    assert cpu("fpu sse2 avx2 fma avx512_vnni_only_in_name") == AVX2_TILES
    assert cpu("fpu sse2 avx2") is None and cpu("fpu sse2") is None  # AVX2 without FMA: IREE's own tiles
    assert host_tiles(tmp_path / "missing") is None


def test_only_the_host_target_with_tiles_and_without_data_tiling_is_tuned(monkeypatch):
    """Tiles (and the shapes they tune) on the host target alone, without data tiling; the IREE CPU layout on
    CPU targets without data tiling, tiles or not."""
    text = exported(lambda w, h: w @ h, f32(64, 32), f32(32, 64))
    for tiles in (AVX512_TILES, AVX2_TILES):
        monkeypatch.setattr(targets, "host_tiles", lambda tiles=tiles: tiles)
        assert target_tiles(TARGETS["host"], False) == tiles and tunable_matmuls(text, tiles) == [(64, 32, 64)]
        for name, data_tiling in (("host", True), ("vulkan", False), ("android-arm64", False)):
            assert target_tiles(TARGETS[name], data_tiling) is None
    monkeypatch.setattr(targets, "host_tiles", lambda: None)
    assert target_tiles(TARGETS["host"], False) is None and tunable_matmuls(text, None) == []
    assert TARGETS["host"].layout_rule(False) == TARGETS["android-arm64"].layout_rule(False) == IREE_CPU_LAYOUT
    assert TARGETS["host"].layout_rule(True) == TARGETS["vulkan"].layout_rule(False) == POSITION_MAJOR


@pytest.fixture
def fake_compiles(monkeypatch, tmp_path) -> list:
    """The bundle cache under `tmp_path`, its compiles replaced by an empty bundle each: the list of their outputs."""
    compiled = []

    def compile_bundle(model_dir, target, out, **options):
        compiled.append(out)
        out.mkdir(parents=True)
        (out / bundle_cache.MANIFEST).write_text("{}")

    monkeypatch.setenv("LLADA_CACHE", str(tmp_path))
    monkeypatch.setattr(bundle_cache, "compile_bundle", compile_bundle)
    return compiled


def test_bundles_compiled_on_the_fly_are_cached_per_host_tiles(monkeypatch, fake_compiles, tiny_dir):
    """A bundle cached under one host's tiles is not reused under another's; under the same tiles it is."""
    paths = []
    for tiles in (AVX2_TILES, AVX512_TILES, AVX2_TILES):
        monkeypatch.setattr(bundle_cache, "host_tiles", lambda tiles=tiles: tiles)
        paths.append(bundle_cache.cached_bundle(tiny_dir, "host"))
    assert paths[0] != paths[1] and paths[2] == paths[0] and fake_compiles == paths[:2]


def test_bundles_compiled_on_the_fly_are_cached_per_kernel_flags(monkeypatch, fake_compiles, tiny_dir):
    """A host bundle whose kernels were built for another ISA ($LLADA_KERNELS_ARCH) is not reused."""
    host = TARGETS["host"]
    if host.kernels is None:
        pytest.skip("no kernels for this host's architecture")
    paths = []
    for flags in (("-march=native",), ("-march=x86-64-v3",), ("-march=native",)):
        monkeypatch.setitem(TARGETS, "host", dataclasses.replace(host, kernels=dataclasses.replace(host.kernels,
                                                                                                     flags=flags)))
        paths.append(bundle_cache.cached_bundle(tiny_dir, "host"))
    assert paths[0] != paths[1] and paths[2] == paths[0] and fake_compiles == paths[:2]


def test_the_spec_is_applied_in_a_phase_of_its_own_on_one_thread(tmp_path):
    """IREE 3.13 can deadlock loading a spec on its thread pool (`lowering.bundle.TUNED_PHASES`)."""
    phases = [tmp_path / "sources.mlir", tmp_path / "configured.mlir"]
    plain = _compile_commands(tmp_path / "m.mlir", ("--flag",), tmp_path / "m.vmfb", None, phases)
    tuned = _compile_commands(tmp_path / "m.mlir", ("--flag",), tmp_path / "m.vmfb", tmp_path / "s.mlir", phases)
    assert len(plain) == 1 and not any("tuning-spec" in arg or "threading" in arg for arg in plain[0])
    with_spec = [command for command in tuned if f"--iree-codegen-tuning-spec-path={tmp_path / 's.mlir'}" in command]
    assert len(tuned) == 3 and with_spec == [tuned[1]] and "--mlir-disable-threading" in tuned[1]
    assert not any("--mlir-disable-threading" in command for command in (tuned[0], tuned[2]))
    assert [command[command.index("-o") + 1] for command in tuned] == [*map(str, phases), str(tmp_path / "m.vmfb")]
    assert all("--flag" in command for command in tuned)


def _compile(tmp_path, text: str, spec: str | None, name: str) -> tuple[bytes, str]:
    """Compiled as bundles are (`compile_module`, the host target's flags), with the lowering configs IREE
    chose written under `tmp_path`; returns the module and those configs."""
    configs = tmp_path / f"{name}.configs"
    flags = (*TARGETS["host"].flags, "--mlir-print-ir-after=iree-llvmcpu-select-lowering-strategy",
             f"--mlir-print-ir-tree-dir={configs}")
    compile_module(text, flags, tmp_path / f"{name}.vmfb", timeout=300, tuning=spec)
    chosen = "\n".join(file.read_text() for file in sorted(configs.rglob("*.mlir")))
    return (tmp_path / f"{name}.vmfb").read_bytes(), chosen


def _run(vmfb: bytes, *inputs) -> np.ndarray:
    import iree.runtime as rt

    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return np.asarray(context.modules.jit_chain.main(*inputs).to_host())


@settings(max_examples=4)
@given(m=st.integers(1, 24).map(lambda i: 8 * i), k=st.integers(1, 300), n=st.integers(1, 5).map(lambda i: 32 * i),
       seed=st.integers(0, 2**16), tiles=st.sampled_from([AVX512_TILES, AVX2_TILES]))
def test_tuned_matmuls_compute_what_untuned_ones_do(tmp_path_factory, m, k, n, seed, tiles: Tiles):
    """Two products in a row (the second one's K is the first one's M; K a multiple of the sum's unrolling
    or not), with and without the tiles. AVX-512 tiles are given to an AVX2 host too: IREE's x86
    code for them spills registers, but computes the same."""
    def chain(w1, w2, h):
        return w2 @ jnp.tanh(w1 @ h)

    rng = np.random.default_rng(seed)
    w1, w2 = rng.standard_normal((m, k), np.float32), rng.standard_normal((m, m), np.float32)
    h = rng.standard_normal((k, n), np.float32)
    text = exported(chain, f32(m, k), f32(m, m), f32(k, n))
    shapes = tunable_matmuls(text, tiles)
    assert shapes == sorted({(m, k, n), (m, m, n)})
    tmp = tmp_path_factory.mktemp("tiles")
    plain, _ = _compile(tmp, text, None, "plain")
    tuned, log = _compile(tmp, text, tuning_spec(shapes, tiles), "tuned")
    (group_rows, group_columns), (rows, columns), unroll = tiles
    assert (f"<distribution = [{group_rows}, {group_columns}, 0], vector_common_parallel = "
            f"[{rows}, {columns}, 0], vector_reduction = [0, 0, {unroll}]>") in log
    got, want = _run(tuned, w1, w2, h), _run(plain, w1, w2, h)
    assert np.array_equal(got, want)
    np.testing.assert_allclose(got, w2 @ np.tanh(w1 @ h), rtol=2e-4, atol=2e-4 * np.sqrt(m * k))
