"""IREE bundles: same numbers as JAX (host and Vulkan), same tokens for every decoder, phone targets
compile, bad bundles are refused, and the runtime never imports JAX."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llada_jax
from llada_jax.backends.iree import IreeBackend, Session, load_bundle
from llada_jax.backends.select import OpenBundle
from llada_jax.bundle_runner import generate_with_bundle
from llada_jax.model.readout import ReadoutSpec, TokenBiases
from llada_jax.system.errors import LladaError
from lowering import bundle as bundle_mod
from lowering.bundle import compile_bundle
from lowering.bundle_format import MANIFEST_DIGEST, manifest_digest
from lowering.matmul_tiles import host_tiles
from lowering.targets import TARGETS
from tests.conftest import BUNDLE_MAX_LEN, TINY, bundle_weight_bytes, jax_backend, require, vulkan_available

pytestmark = pytest.mark.slow  # IREE compiles or child processes: the full tier only

MAX_LEN = BUNDLE_MAX_LEN
POLICIES = ["vanilla", "prefix-cache", "dual-cache"]


@pytest.fixture(scope="session")
def host_session(host_bundle):
    bundle = load_bundle(host_bundle, "host")
    return bundle, Session(bundle.path, bundle.manifest, "local-task")


def iree_backend(host_session):
    bundle, session = host_session
    return IreeBackend(bundle, session, ReadoutSpec(), TokenBiases.build(TINY.embedding_size))


def random_canvas(seed: int, slots: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TINY.vocab_size, (1, slots)).astype(np.int32)
    tokens[rng.random((1, slots)) < 0.4] = TINY.mask_token_id
    return tokens, np.arange(slots)[None] < length


def assert_close(got, want, tol=1e-4):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max())


def test_unknown_target_is_refused_before_iree_runs(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "compile_module", lambda *a: pytest.fail("iree-compile was called"))
    with pytest.raises(LladaError, match="unknown target 'mali-g99'"):
        compile_bundle(tiny_dir, "mali-g99", tmp_path / "b")


def test_a_failed_iree_compile_is_one_line_naming_its_phase(tmp_path):
    """iree-compile's own message (from stderr, or stdout when stderr is empty), its exit status, and which of
    the tuned compile's phases failed."""
    with pytest.raises(LladaError) as error:
        bundle_mod.compile_module("this is not MLIR", TARGETS["host"].flags, tmp_path / "x.vmfb", timeout=300,
                                  tuning="")
    message = str(error.value)
    assert message.startswith("iree-compile failed (exit status 1) in phase 1 of 3: ") and "\n" not in message
    assert not list(tmp_path.iterdir())  # no source or phase files left behind


def test_manifest_describes_every_step_and_file(host_bundle):
    manifest = json.loads((host_bundle / "manifest.json").read_text())
    assert manifest["target"] == "host" and manifest["iree_version"] and manifest["max_len"] == MAX_LEN
    names = {step["name"] for step in manifest["steps"]}
    assert {"full_b1_s8", "full_b1_s32", "window_b1_s32_w8", "commit_b1_s32_w32"} <= names
    window = next(s for s in manifest["steps"] if s["name"] == "window_b1_s32_w8")
    assert [i["name"] for i in window["inputs"]][:6] == ["keys", "values", "context_bias", "window_ids",
                                                         "window_pos", "window_valid"]
    assert {"steps.vmfb", "weights.irpa", "manifest.json"} - set(manifest["files"]) == {"manifest.json"}
    # the float32 products over positions (batch x width) the host's register block divides run on its tiles
    tiles, tuned = host_tiles(), manifest["tuned_matmuls"]
    assert bool(tuned) == (tiles is not None)
    assert manifest["matmul_tiles"] == (json.loads(json.dumps(tiles._asdict())) if tiles else None)
    assert all(m % tiles.registers[0] == 0 and n % tiles.registers[1] == 0 for m, _, n in tuned)


@settings(max_examples=10)
@given(slots=st.sampled_from([8, 16, 32]), data=st.data(), seed=st.integers(0, 10_000))
def test_iree_steps_match_jax(tiny_model, host_session, slots, data, seed):
    length = data.draw(st.integers(1, slots))
    tokens, valid = random_canvas(seed, slots, length)
    jax_b, iree_b = jax_backend(tiny_model), iree_backend(host_session)
    want, got = jax_b.full(tokens, valid), iree_b.full(tokens, valid)
    n = length
    assert got.readout.x0[:, :n].tolist() == want.readout.x0[:, :n].tolist()
    assert_close(got.readout.logp[:, :n], want.readout.logp[:, :n])
    assert_close(host_session[1].read(got.keys)[:, :, :n], np.asarray(want.keys)[:, :, :n])
    # A window placed anywhere in the canvas, against everything else committed from that full step.
    start = data.draw(st.integers(0, length - 1))
    end = data.draw(st.integers(start + 1, length))
    width = data.draw(st.sampled_from([w for w in (8, 16, 32) if end - start <= w <= slots]))
    everything = np.arange(slots)[None]
    states = [b.commit(b.empty_state(1, slots), everything, valid, out, tokens, 0)
              for b, out in ((jax_b, want), (iree_b, got))]
    positions = np.zeros((1, width), np.int64)
    positions[0, : end - start] = np.arange(start, end)
    window_valid = np.arange(width)[None] < end - start
    visible = valid & ~((everything >= start) & (everything < end))
    ids = np.where(window_valid, tokens[0, positions], 0)
    want_w = jax_b.window(states[0], visible, ids, positions, window_valid)
    got_w = iree_b.window(states[1], visible, ids, positions, window_valid)
    k = end - start
    assert got_w.readout.x0[:, :k].tolist() == want_w.readout.x0[:, :k].tolist()
    assert_close(got_w.readout.logp[:, :k], want_w.readout.logp[:, :k])
    # Reading out some columns only (the LM head on those rows, padded to a declared width, then cut on the
    # host) gives those columns of the whole readout.
    reads = tuple(sorted(data.draw(st.sets(st.integers(0, k - 1), min_size=1))))
    canvas_reads = tuple(sorted(data.draw(st.sets(st.integers(start, end - 1), min_size=1))))
    for backend, state in ((jax_b, states[0]), (iree_b, states[1])):
        part = backend.window(state, visible, ids, positions, window_valid, reads).readout
        assert part.x0.tolist() == want_w.readout.x0[:, list(reads)].tolist()
        assert_close(part.logp, want_w.readout.logp[:, list(reads)])
        part = backend.full(tokens, valid, canvas_reads).readout
        assert part.x0.tolist() == want.readout.x0[:, list(canvas_reads)].tolist()
        assert_close(part.logp, want.readout.logp[:, list(canvas_reads)])


def test_iree_commit_leaves_the_old_state_intact(host_session):
    backend = iree_backend(host_session)
    tokens, valid = random_canvas(0, 16, 16)
    before = backend.empty_state(1, 16)
    after = backend.commit(before, np.arange(16)[None], valid, backend.full(tokens, valid), tokens, 0)
    session = host_session[1]
    assert np.abs(session.read(before.keys)).max() == 0.0
    assert np.abs(session.read(after.keys)).max() > 0.0 and after.filled.all() and not before.filled.any()


@pytest.mark.parametrize("policy", POLICIES + ["dual-cache+speculative:1:0.3", "dual-cache+speculative+revision:0.4"])
@pytest.mark.parametrize("threshold", [None, 0.2])
def test_decoders_give_identical_tokens_through_iree_and_jax(tiny_model, host_session, policy, threshold):
    bundle, session = host_session
    for seed in range(3):
        prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, 5 + seed)
        options = dict(gen_length=16, block_length=8, steps=8, policy=policy, threshold=threshold)
        want = llada_jax.generate(tiny_model, prompt, **options)
        got = generate_with_bundle(OpenBundle(bundle, session), prompt, **options)
        assert got.output_ids.tolist() == want.output_ids.tolist() and got.nfe == want.nfe
        assert [r.revisions for r in got.trace] == [r.revisions for r in want.trace]


def test_revision_side_path_runs_inline_on_the_host_cpu(host_session):
    """Where the dense path runs on the host's own cores, XLA beside it would only take turns with it."""
    bundle, session = host_session
    got = generate_with_bundle(OpenBundle(bundle, session), np.arange(3, 9), gen_length=16, block_length=8,
                               steps=8, policy="dual-cache+revision:0.4")
    assert got.stats["probes"] > 0 and got.stats["side_concurrent"] is False


def test_bundle_canvas_limit_is_a_clear_error(host_session):
    bundle, session = host_session
    with pytest.raises(LladaError, match="compiled with --max-len 32"):
        generate_with_bundle(OpenBundle(bundle, session), np.arange(20), gen_length=16, block_length=8, steps=8)


VULKAN_CHILD = """
import json, sys
import numpy as np
from llada_jax.backends.select import OpenBundle
from llada_jax.bundle_runner import generate_with_bundle
from llada_jax.model.readout import ReadoutSpec, TokenBiases
from llada_jax.backends.iree import IreeBackend, Session, load_bundle

path, policies, tokens, valid = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
bundle = load_bundle(path, "vulkan")
session = Session(bundle.path, bundle.manifest, "vulkan")
results = {policy: generate_with_bundle(OpenBundle(bundle, session), np.arange(3, 9), gen_length=8,
                                        block_length=4, steps=4, policy=policy) for policy in policies}
readout = IreeBackend(bundle, session, ReadoutSpec(), TokenBiases.build(bundle.config.embedding_size)).full(
    np.array(tokens), np.array(valid)).readout
print(json.dumps({"ids": {policy: result.output_ids.tolist() for policy, result in results.items()},
                  "revisions": {policy: [list(r.revisions) for r in result.trace]
                                for policy, result in results.items()},
                  "side_concurrent": {policy: result.stats.get("side_concurrent")
                                      for policy, result in results.items()},
                  "logp": np.asarray(readout.logp).tolist()}))
"""
VULKAN_POLICIES = POLICIES + ["dual-cache+speculative+revision:0.4"]


def test_vulkan_matches_jax(tiny_dir, tiny_model, tmp_path):
    """In a process of its own: once a Vulkan device exists, Mesa's lavapipe keeps threads spinning until the
    process ends (about one core here), which would slow every later test."""
    require(vulkan_available(), "a Vulkan driver (Mesa's mesa-vulkan-drivers and libvulkan1)")
    path = compile_bundle(tiny_dir, "vulkan", tmp_path / "vk", max_len=16, window=16)
    tokens, valid = random_canvas(3, 16, 12)
    child = subprocess.run([sys.executable, "-c", VULKAN_CHILD, str(path), json.dumps(VULKAN_POLICIES),
                            json.dumps(tokens.tolist()), json.dumps(valid.tolist())],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout)
    for policy in VULKAN_POLICIES:
        want = llada_jax.generate(tiny_model, np.arange(3, 9), gen_length=8, block_length=4, steps=4, policy=policy)
        assert got["ids"][policy] == want.output_ids.tolist()
        assert got["revisions"][policy] == [[list(r) for r in record.revisions] for record in want.trace]
    # On a GPU, revision's side path is XLA on the host, beside the dense path.
    assert got["side_concurrent"]["dual-cache+speculative+revision:0.4"] is True
    want = jax_backend(tiny_model).full(tokens, valid)
    assert_close(np.array(got["logp"])[:, :12], want.readout.logp[:, :12])


@pytest.mark.parametrize("target", ["android-arm64", "android-adreno", "android-mali"])
def test_phone_targets_compile(tiny_dir, tmp_path, target):
    path = compile_bundle(tiny_dir, target, tmp_path / target, max_len=8, window=8)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["target"] == target and (path / "steps.vmfb").stat().st_size > 10_000


def corrupt_vmfb(path):
    data = bytearray((path / "steps.vmfb").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "steps.vmfb").write_bytes(bytes(data))


def edited_manifest(edit, digest: bool):
    """A fault: the manifest edited, its checksum recomputed (`digest`, as another compiler would write it) or not."""
    def fault(path):
        manifest = json.loads((path / "manifest.json").read_text())
        edit(manifest)
        if digest:
            manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
    return fault


@pytest.mark.parametrize("fault, message", [
    (corrupt_vmfb, "steps.vmfb does not match its checksum"),
    (edited_manifest(lambda m: m.update(iree_version="1.0.0"), digest=True), "compiled with IREE 1.0.0"),
    (edited_manifest(lambda m: m.pop("files"), digest=False), "manifest.json does not match its checksum"),
    (edited_manifest(lambda m: m["model_config"].update(mask_token_id=3), digest=False), "does not match its checksum"),
    (edited_manifest(lambda m: m.pop("steps"), digest=False), "does not match its checksum"),
    (lambda p: (p / "manifest.json").write_text("[]"), "not a bundle manifest"),
    (edited_manifest(lambda m: m.pop("weights"), digest=True), r"not a bundle manifest \(weights is missing or not an"),
    (edited_manifest(lambda m: m.pop("files"), digest=True), "files is missing or not an object"),
    (edited_manifest(lambda m: m.update(files=[]), digest=True), "files is missing or not an object"),
    (edited_manifest(lambda m: m.update(max_len="x"), digest=True), "max_len is missing or not an integer"),
    (edited_manifest(lambda m: m.update(max_len=True), digest=True), "max_len is missing or not an integer"),
    (edited_manifest(lambda m: m.update(weights={}), digest=True), "weights has no list of files"),
    (edited_manifest(lambda m: m.update(weights={"files": [None], "stamps": [[1, 2]]}), digest=True),
     "weights has no list of files"),
    (edited_manifest(lambda m: m["steps"].append(5), digest=True), "a step is not an object"),
    (edited_manifest(lambda m: m.update(files={"steps.vmfb": 5}), digest=True), "files is not a map of names"),
    (lambda p: (p / "weights.irpa").unlink(), "weights.irpa is missing"),
    (lambda p: (p / "manifest.json").unlink(), "is not a bundle"),
])
def test_bad_bundles_are_refused(host_bundle, tmp_path, fault, message):
    copy = tmp_path / "copy"
    shutil.copytree(host_bundle, copy)
    fault(copy)
    with pytest.raises(LladaError, match=message):
        load_bundle(copy)


def test_bundle_for_another_target_is_refused(host_bundle):
    with pytest.raises(LladaError, match="bundle targets 'host', not 'vulkan'"):
        load_bundle(host_bundle, "vulkan")


def test_bundle_runtime_imports_neither_jax_nor_the_compiler(host_bundle):
    script = (f"import sys, numpy as np\nfrom llada_jax.bundle_runner import bundle_runner\n"
              f"config, tok, run = bundle_runner({str(host_bundle)!r})\n"
              f"r = run(np.arange(3, 9), gen_length=8, block_length=8, steps=8, policy='dual-cache')\n"
              f"assert len(r.output_ids) == 8\n"
              f"print(sorted(m for m in sys.modules if m.startswith(('jax', 'iree.compiler'))))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_iree_backend_refuses_sampling_it_cannot_run(host_session):
    bundle, session = host_session
    with pytest.raises(LladaError, match="use temperature 0, cfg-scale 0"):
        generate_with_bundle(OpenBundle(bundle, session), np.arange(3, 6), gen_length=8, block_length=8, steps=8,
                             temperature=0.5)


def test_embedded_model_decoders_identical_through_iree_and_jax(tmp_path):
    from llada_jax.system.locations import default_model_dir
    from llada_jax.training.tasks import held_out

    model = llada_jax.load(default_model_dir())
    bundle = load_bundle(compile_bundle(default_model_dir(), "host", tmp_path / "embedded", max_len=128, window=16))
    session = Session(bundle.path, bundle.manifest, "local-task")
    for example in held_out(1):
        ids = np.array(model.tokenizer.encode(model.tokenizer.chat_prompt(example.prompt)))
        for policy, threshold in (("vanilla", None), ("dual-cache", 0.9), ("dual-cache+speculative+revision", 0.7)):
            options = dict(gen_length=32, block_length=8, steps=32, policy=policy, threshold=threshold)
            want = llada_jax.generate(model, ids, **options)
            got = generate_with_bundle(OpenBundle(bundle, session), ids, **options)
            assert got.output_ids.tolist() == want.output_ids.tolist(), (example.prompt, policy)


@pytest.fixture(scope="module")
def tiled_session(tiny_dir, tmp_path_factory):
    path = compile_bundle(tiny_dir, "host", tmp_path_factory.mktemp("tiled") / "host", max_len=16, window=16,
                          data_tiling=True)
    bundle = load_bundle(path, "host")
    return bundle, Session(bundle.path, bundle.manifest, "local-task")


@settings(max_examples=6, deadline=None)
@given(policy=st.sampled_from(POLICIES + ["dual-cache+speculative+revision"]),
       threshold=st.sampled_from([None, 0.3]), prompt_len=st.integers(1, 8), seed=st.integers(0, 1000))
def test_data_tiled_bundle_decodes_as_jax(tiny_model, tiled_session, policy, threshold, prompt_len, seed):
    """Data tiling re-lays the weights for IREE's CPU kernels: the same tokens as XLA for every decoder."""
    bundle, session = tiled_session
    assert "--iree-opt-data-tiling" in bundle.manifest["flags"]
    prompt = np.random.default_rng(seed).integers(0, TINY.mask_token_id, prompt_len)
    options = dict(gen_length=8, block_length=4, steps=8, policy=policy, threshold=threshold)
    got = generate_with_bundle(OpenBundle(bundle, session), prompt, **options)
    assert got.output_ids.tolist() == llada_jax.generate(tiny_model, prompt, **options).output_ids.tolist()


def test_data_tiling_is_refused_where_it_cannot_help(tiny_dir, tmp_path, capsys):
    from llada_jax.cli import main

    streams = bundle_weight_bytes(tiny_dir) - 1  # fits the streaming ring
    for target, budget, message in (("vulkan", None, "for CPU targets"), ("host", streams, "needs resident weights")):
        with pytest.raises(LladaError, match=message):
            compile_bundle(tiny_dir, target, tmp_path / "b", max_len=8, window=8, device_memory_budget=budget,
                           data_tiling=True)
    assert not (tmp_path / "b").exists()
    assert main(["generate", "--model", str(tiny_dir), "--data-tiling", "--gen-length", "8", "--prompt-ids", "1"]) == 1
    assert "use it with --backend iree-host" in capsys.readouterr().err


def test_compile_timeout_is_settable_and_checked_first(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LLADA_COMPILE_TIMEOUT_S", "soon")
    monkeypatch.setattr(bundle_mod, "bundle_module", lambda *a: pytest.fail("exported before the check"))
    with pytest.raises(LladaError, match="LLADA_COMPILE_TIMEOUT_S must be a positive number of seconds, got 'soon'"):
        compile_bundle(tiny_dir, "host", tmp_path / "b", max_len=8, window=8)
    monkeypatch.undo()
    monkeypatch.setenv("LLADA_COMPILE_TIMEOUT_S", "0.001")
    with pytest.raises(LladaError, match=r"iree-compile took longer than 0.001 s and was stopped"):
        compile_bundle(tiny_dir, "host", tmp_path / "b", max_len=8, window=8)
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))  # no partial bundle left


def test_a_decoder_wider_than_the_bundles_windows_is_told_how_to_fit(tiny_dir, tmp_path, capsys):
    from llada_jax.cli import main

    bundle = compile_bundle(tiny_dir, "host", tmp_path / "narrow", max_len=16, window=8)
    assert main(["generate", "--bundle", str(bundle), "--no-visual", "--gen-length", "8", "--prompt-ids", "3,4,5"]) == 1
    assert capsys.readouterr().err == (
        "llada: error: the decoder needs a window of 16 positions on a canvas of 16, and this bundle's windows are "
        "[8] wide: compile it with --window 16 or more, or run a decoder with narrower windows (a smaller "
        "--block-length, no lookahead)\n")


@pytest.mark.parametrize("flags, words", [
    (["--dtype", "bfloat16"], "compiled with --dtype float32; drop --dtype bfloat16"),
    (["--dtype", "nonsense"], "drop --dtype nonsense"),
    (["--activations", "int8"], "compiled with --activations float; drop --activations int8"),
    (["--check-weights"], "checked by their checksums"),
    (["--kernels", "own"], "drop --kernels"),
])
def test_model_flags_a_bundle_cannot_follow_are_refused_not_ignored(host_bundle, capsys, flags, words):
    from llada_jax.cli import main

    assert main(["generate", "--bundle", str(host_bundle), "--prompt-ids", "3,4", "--gen-length", "8",
                 "--block-length", "8", "--steps", "8", "--no-visual", *flags]) == 1
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_a_prompt_file_line_too_long_for_the_bundle_is_named_before_any_answer(host_bundle, tmp_path, capsys):
    """The bundle's --max-len, not the model's context, bounds each line: line 3 fits the model but not the
    bundle, and is refused before the first batch prints."""
    from llada_jax.cli import main

    (tmp_path / "prompts.txt").write_text("3,4\n\n" + "5," * 29 + "5\n")
    assert main(["generate", "--bundle", str(host_bundle), "--prompt-file", str(tmp_path / "prompts.txt"), "--ids",
                 "--batch-size", "1", "--gen-length", "8", "--block-length", "8", "--steps", "8"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"llada: error: line 3 of {tmp_path / 'prompts.txt'}: prompt (30) + gen_length (8) = 38")
    assert "--max-len 32" in err


def test_an_explicit_default_dtype_is_refused_on_a_bundle_compiled_otherwise(tiny_dir, tmp_path, capsys):
    from llada_jax.cli import main

    bundle = compile_bundle(tiny_dir, "host", tmp_path / "bf16", max_len=16, window=16, dtype="bfloat16")
    run = ["generate", "--bundle", str(bundle), "--no-visual", "--gen-length", "8", "--block-length", "8",
           "--steps", "8", "--prompt-ids", "3,4"]
    assert main([*run, "--dtype", "float32"]) == 1
    assert capsys.readouterr().err == ("llada: error: this bundle was compiled with --dtype bfloat16; drop --dtype "
                                       "float32 (or compile another bundle)\n")
    assert main([*run, "--dtype", "bfloat16", "--activations", "float"]) == 0


def test_an_interrupted_compile_leaves_no_compiler_running(tmp_path):
    """iree-compile runs in a session of its own (out of the terminal's reach): SIGTERM or Ctrl-C to llada must
    stop it too, not leave it compiling into a removed scratch directory."""
    import os
    import signal
    import threading

    from llada_jax.system.interrupts import Terminated, sigterm_raises
    from lowering.bundle import _run_compiler

    pidfile = tmp_path / "pid"
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(Terminated), sigterm_raises():
        _run_compiler(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"], 120.0, 120.0)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)
