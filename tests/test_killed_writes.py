"""A write killed mid-way leaves nothing behind and loses nothing: SIGKILL leaves a scratch copy that the next
run of the same target removes (and only that); SIGINT/SIGTERM remove it before exiting; a results file killed
at any moment resumes to the rows of an uninterrupted run."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from llada_jax.model.config import LLaDAConfig
from llada_jax.system.atomic import MARKER, atomic_dir, previous_output
from llada_jax.system.interrupts import Terminated, run_interruptible
from llada_jax.system.scratch import TAG, process_start, remove_stale_scratch, scratch_prefix
from tests.conftest import write_checkpoint
from tests.test_data_safety import snapshot, user_dir

# Wide and deep enough that writing its outputs takes a moment to kill into (about 48 MB of float32).
MEDIUM = LLaDAConfig(d_model=256, n_layers=16, n_heads=4, n_kv_heads=2, mlp_hidden_size=704, vocab_size=512,
                     embedding_size=512, max_sequence_length=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                     mask_token_id=500, eos_token_id=501, eot_token_id=502)


def scratch_of(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.{TAG}."))


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def planted(target: Path) -> dict[str, Path]:
    """Siblings a run must never touch: another target's stale scratch, a live writer's scratch of this target,
    another host's, and a directory of the user's that merely looks alike."""
    host, me = scratch_prefix(target, "x").split(".")[-4], f"{os.getpid()}.{process_start(os.getpid())}"
    names = {
        "other target": f".{target.name}-b.{TAG}.llada-quantize.{host}.{dead_pid()}.0.abcdefgh",
        "live writer": f".{target.name}.{TAG}.llada-quantize.{host}.{me}.abcdefgh",
        "other host": f".{target.name}.{TAG}.llada-quantize.elsewhere.{dead_pid()}.0.abcdefgh",
        "user's": f".{target.name}.mine",
    }
    paths = {}
    for what, name in names.items():
        paths[what] = user_dir(target.parent / name)
    return paths


def test_only_stale_scratch_of_the_same_target_is_removed(tmp_path, capsys):
    target = tmp_path / "out"
    keep = planted(target)
    before = {what: snapshot(path) for what, path in keep.items()}
    stale = tmp_path / f".out.{TAG}.llada-convert.{scratch_prefix(target, 'x').split('.')[-4]}.{dead_pid()}.0.a1b2c3d4"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "weights.bin").write_bytes(b"x" * 5000)
    assert remove_stale_scratch(target) == (1, 5000)
    assert not stale.exists()
    assert {what: snapshot(path) for what, path in keep.items()} == before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "removed 1 scratch copy" in err and "0.0 MB" in err


class FailsInDel:
    """What a signal leaves of a progress bar interrupted inside its __init__: its __del__ raises."""

    def __del__(self):
        raise AttributeError("'tqdm' object has no attribute 'pos'")


@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt, 130), (Terminated, 143)])
def test_an_interrupt_that_leaves_an_object_half_built_still_ends_in_one_line(monkeypatch, capsys, stop, status):
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)

    def work():
        half_built = FailsInDel()  # noqa: F841 (alive in the frame the exception holds)
        raise stop()

    assert run_interruptible("llada", work) == status
    assert capsys.readouterr().err.splitlines() == ["llada: interrupted" + (" (SIGTERM)" if status == 143 else "")]
    assert sys.unraisablehook is sys.__unraisablehook__


def test_a_failed_write_leaves_no_scratch_and_a_finished_one_is_marked(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ZeroDivisionError), atomic_dir(target, "llada convert") as staging:
        (staging / "part").write_text("half")
        1 / 0
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(target, "llada convert") as staging:
        assert scratch_of(target) == [staging.name]
        (staging / "part").write_text("whole")
    assert previous_output(target) == "llada convert" and scratch_of(target) == []


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "llada_jax.cli", *argv]


# SIGINT as a terminal delivers it, even when the tests run as a background job (whose shell ignores SIGINT); a
# launcher that execs, not a preexec_fn, which would fork this multithreaded process
SIGINT_AS_A_TERMINAL = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "os.execv(sys.argv[1], sys.argv[1:])"]


def kill_once_writing(argv: list[str], target: Path, signum: int, delay: float) -> subprocess.CompletedProcess:
    """Run `argv`, send `signum` `delay` seconds after its scratch copy of `target` appears (or on exit)."""
    known = set(scratch_of(target))
    proc = subprocess.Popen([*SIGINT_AS_A_TERMINAL, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not set(scratch_of(target)) - known and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(argv, proc.returncode, "", err)


@pytest.fixture(scope="module")
def medium_in_folder(tmp_path_factory) -> Path:
    folder = user_dir(tmp_path_factory.mktemp("models") / "models")
    return write_checkpoint(folder / "medium", MEDIUM, shard_bytes=400_000)  # 83 shards: a write of many steps


WRITERS = {
    "quantize": ["quantize", "--bits", "4", "--model", "{model}", "--out"],
    "convert": ["convert", "--model", "{model}", "--out"],
}


def writer_argv(name: str, model: Path, target: Path) -> list[str]:
    """The command writing `target` (replacing its own earlier output there, if a kill came too late)."""
    force = ["--force"] if target.exists() else []
    return cli(*[arg.replace("{model}", str(model)) for arg in WRITERS[name]], str(target), *force)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_sigkills_then_one_run_leave_no_scratch_and_the_input_intact(tmp_path, medium_in_folder, name):
    inputs = snapshot(medium_in_folder.parent)
    target = tmp_path / "out"
    keep = planted(target)
    kept = {what: snapshot(path) for what, path in keep.items()}
    planted_names = [keep["live writer"].name, keep["other host"].name]
    left = []
    for delay in (0.0, 0.0, 0.05, 0.3, None):  # None: the run that is not killed
        before = [name for name in scratch_of(target) if name not in planted_names]
        argv = writer_argv(name, medium_in_folder, target)
        if delay is None:
            run = subprocess.run(argv, capture_output=True, text=True, check=False)
        else:
            run = kill_once_writing(argv, target, signal.SIGKILL, delay)
        assert run.returncode in (-signal.SIGKILL, 0), run.stderr
        assert ("left by killed runs" in run.stderr) == bool(before), run.stderr
        assert snapshot(medium_in_folder.parent) == inputs
        assert not target.exists() or previous_output(target) == f"llada {name}"
        left += before
    assert left, "no kill landed during the write"
    assert previous_output(target) == f"llada {name}" and (target / MARKER).is_file()
    assert scratch_of(target) == sorted(planted_names)
    assert {what: snapshot(path) for what, path in keep.items()} == kept


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_sigint_and_sigterm_remove_the_scratch_before_exiting(tmp_path, medium_in_folder, name, signum, status):
    inputs = snapshot(medium_in_folder.parent)
    target = tmp_path / "out"
    for _ in range(5):  # the write can finish between its scratch appearing and the signal: a lost race, again
        stopped = kill_once_writing(writer_argv(name, medium_in_folder, target), target, signum, 0.0)
        if stopped.returncode != 0:
            break
        shutil.rmtree(target)
    else:  # what the last writer said tells a lost race (nothing) from a signal it let pass
        pytest.fail(f"the write finished before the signal five times; last stderr: {stopped.stderr[-400:]!r}")
    assert stopped.returncode == status, stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1].startswith("llada: interrupted")
    assert "Traceback" not in stopped.stderr and "Exception ignored" not in stopped.stderr
    assert sorted(tmp_path.iterdir()) == []
    assert snapshot(medium_in_folder.parent) == inputs


@pytest.mark.slow
def test_a_compile_killed_then_rerun_leaves_no_scratch(tmp_path, tiny_dir):
    target = tmp_path / "bundle"
    argv = cli("compile", "--target", "host", "--max-len", "48", "--window", "16", "--gen-length", "16",
               "--model", str(tiny_dir), "--out", str(target))
    inputs, temporary = snapshot(tiny_dir), set(Path(tempfile.gettempdir()).glob("llada-kernels-*"))
    killed = kill_once_writing(argv, target, signal.SIGKILL, 0.0)
    assert killed.returncode == -signal.SIGKILL and not target.exists() and scratch_of(target)
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "left by killed runs" in done.stderr, done.stderr
    assert previous_output(target) == "llada compile" and scratch_of(target) == []
    assert snapshot(tiny_dir) == inputs
    assert set(Path(tempfile.gettempdir()).glob("llada-kernels-*")) == temporary  # the kernels' objects: scratch too


def gsm8k_file(path: Path, count: int) -> Path:
    rows = [{"question": f"What is {n} plus {n + 1}?", "answer": f"{n} + {n + 1} = {2 * n + 1}\n#### {2 * n + 1}"}
            for n in range(count)]
    with gzip.open(path, "wt") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
    return path


def result_rows(path: Path) -> list[dict]:
    """The rows without their timings, which differ from run to run."""
    timings = ("latency_s", "share_s")
    return [{k: v for k, v in json.loads(line).items() if k not in timings} for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_results_file_killed_at_any_moment_resumes_to_the_uninterrupted_rows(tmp_path):
    data = gsm8k_file(tmp_path / "problems.jsonl.gz", 6)
    flags = ["--data", str(data), "--gen-length", "8", "--block-length", "8", "--policy", "vanilla"]
    whole = tmp_path / "whole.jsonl"
    assert subprocess.run(cli("eval", "gsm8k", *flags, "--out", str(whole)), capture_output=True,
                          check=False).returncode == 0
    resumed = tmp_path / "resumed.jsonl"
    argv = cli("eval", "gsm8k", *flags, "--out", str(resumed))
    for rows_before_kill, delay in ((0, 0.0), (1, 0.003), (3, 0.011)):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and (not resumed.exists() or resumed.read_text().count("\n") < rows_before_kill):
            time.sleep(0.001)
        time.sleep(delay)
        proc.kill()
        proc.wait()
    with open(resumed, "ab") as handle:
        handle.write(b'{"index": 5, "prompt": "What')  # a row cut off by the kill
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "dropped its last row, cut off by a killed run" in done.stderr
    assert result_rows(resumed) == result_rows(whole)


def test_one_run_writes_a_results_file_at_a_time(tmp_path):
    from eval.jsonl import RowWriter
    from llada_jax.system.errors import LladaError

    out = tmp_path / "results.jsonl"
    with RowWriter(out) as first:
        first.write({"index": 0, "run": {}})
        with pytest.raises(LladaError, match="being written by another run"):
            RowWriter(out)
    assert out.read_text() == '{"index": 0, "run": {}}\n'
    with RowWriter(tmp_path / "unused.jsonl"):
        pass
    assert not (tmp_path / "unused.jsonl").exists()  # created by the writer, left empty: removed


# Each racer fills its copy, checks the target when both have (at `meet`), and publishes a second later: both
# checks see no entry, so the second publisher finds the first's in place.
RACER = """
import sys, time
from pathlib import Path
from llada_jax.system import atomic
out, meet, name = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
publish = atomic.replace_dir
def later(*args):
    time.sleep(max(0.0, meet + 1 - time.time()))
    publish(*args)
atomic.replace_dir = later
wrote = []
def write():
    wrote.append(name)
    with atomic.atomic_dir(out, "race") as staging:
        (staging / "entry").write_text(name)
        time.sleep(max(0.0, meet - time.time()))
atomic.write_once(out, lambda out: (out / "entry").is_file(), write)
print(bool(wrote), (out / "entry").read_text())
"""


@pytest.mark.slow
def test_two_processes_writing_one_cache_entry_both_get_the_first_published(tmp_path):
    """Concurrent writers of the same cache entry (two `llada generate --backend iree` compiling one bundle, two
    test workers fetching the arm64 tools): both succeed, one copy is kept whole, the other leaves no scratch."""
    out, meet = tmp_path / "entry", time.time() + 8
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(out), str(meet), name], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    results = [racer.communicate(timeout=120) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err for _, err in results]
    kept = (out / "entry").read_text()
    assert sorted(stdout.split()[0] for stdout, _ in results) == ["True", "True"]  # both raced into their write
    assert {stdout.split()[1] for stdout, _ in results} == {kept}
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "entry"]) and not scratch_of(out)
