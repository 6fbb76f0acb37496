"""Evaluation over several hosts: each host's share, its part file, the merge, and a real two-process run
joined through jax.distributed (two simulated devices each, their batches split over a data axis)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.hosts import HostShare, merge
from eval.jsonl import read_rows
from llada_jax.system.errors import LladaError
from tests.test_gsm8k import TINY_RUN, char_model_dir  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent


@given(count=st.integers(1, 9), problems=st.integers(0, 40))
def test_every_problem_belongs_to_exactly_one_host(count, problems):
    shares = [HostShare(index, count) for index in range(count)]
    for number in range(problems):
        assert sum(share.owns(number) for share in shares) == 1


def test_part_files_are_named_by_host():
    out = Path("runs/gsm8k.jsonl")
    assert HostShare().part(out) == out
    assert HostShare(2, 4).part(out) == Path("runs/gsm8k-host2-of-4.jsonl")
    with pytest.raises(LladaError, match=r"must be in \[0, 2\)"):
        HostShare(2, 2)


def write_part(out: Path, host: int, count: int, indices, run=None, problems=4) -> None:
    rows = [{"index": index, "run": run or {"suite": "gsm8k"}, "problems": problems, "correct": True}
            for index in indices]
    HostShare(host, count).part(out).write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_merge_joins_parts_in_problem_order(tmp_path):
    out = tmp_path / "gsm8k.jsonl"
    write_part(out, 0, 2, [0, 2])
    write_part(out, 1, 2, [1, 3])
    assert [row["index"] for row in merge(out)] == [0, 1, 2, 3]
    assert [row["index"] for row in read_rows(out)] == [0, 1, 2, 3]


@pytest.mark.parametrize(("parts", "message"), [
    ([(0, 2, [0, 2])], "no part file from host 1 of 2"),
    ([(0, 2, [0, 2]), (1, 2, [1])], "1 of 4 problems have no row yet"),
    ([(0, 2, [0, 2]), (1, 2, [1, 2, 3])], "problem 2 is in two part files"),
    ([(0, 2, [0, 2]), (1, 3, [1, 3])], "part files of runs over 2 and 3 hosts"),
    ([], "no part files gsm8k-hostI-of-N.jsonl"),
])
def test_merge_refuses_what_would_be_wrong(tmp_path, parts, message):
    out = tmp_path / "gsm8k.jsonl"
    for host, count, indices in parts:
        write_part(out, host, count, indices)
    with pytest.raises(LladaError, match=message):
        merge(out)
    assert not out.exists()


def part_with(out: Path, host: int, count: int, row: dict) -> None:
    """Host `host`'s part: problems 0-2 of 3 (host 0 holds 0 and 2), with `row`'s fields in its first row."""
    rows = [{"index": index, "run": {"suite": "gsm8k"}, "problems": 3, "correct": True} for index in (0, 2)]
    rows[0].update(row)
    HostShare(host, count).part(out).write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("row, stray, message", [
    ({}, ("R-host0-of-99999999999.jsonl", ""), "part files of runs over 2 and 99999999999 hosts"),
    ({}, ("R-host5-of-2.jsonl", ""), "names host 5 of 2, and hosts count from 0"),
    ({"index": 1000000}, None, "a part holds problem 1000000, beyond the run's 3 problems"),
    ({"index": -1}, None, "a results row's index is a problem's number, not -1"),
    ({"problems": 10**10}, None, "parts were run over different numbers of problems"),
    ({"problems": "3"}, None, "field problems holds '3'"),
    ({"correct": "no"}, None, "field correct holds 'no'"),
])
def test_merge_refuses_rows_and_parts_no_run_wrote(tmp_path, row, stray, message):
    out = tmp_path / "R.jsonl"
    part_with(out, 0, 2, row)
    HostShare(1, 2).part(out).write_text(json.dumps({"index": 1, "run": {"suite": "gsm8k"}, "problems": 3,
                                                     "correct": False}) + "\n")
    if stray:
        (tmp_path / stray[0]).write_text(stray[1])
    with pytest.raises(LladaError, match=re.escape(message)):
        merge(out)
    assert not out.exists()


def test_merge_finds_the_first_missing_problem_of_a_huge_count(tmp_path):
    out = tmp_path / "R.jsonl"
    write_part(out, 0, 2, [0, 2], problems=10**10)
    write_part(out, 1, 2, [1], problems=10**10)
    with pytest.raises(LladaError, match="9999999997 of 10000000000 problems have no row yet \\(first: 3\\)"):
        merge(out)


def test_merge_refuses_empty_parts_and_foreign_rows(tmp_path):
    out = tmp_path / "gsm8k.jsonl"
    write_part(out, 0, 2, [])
    write_part(out, 1, 2, [])
    with pytest.raises(LladaError, match="the part files hold no rows yet"):
        merge(out)
    HostShare(1, 2).part(out).write_text(json.dumps({"index": 1, "correct": True}) + "\n")
    with pytest.raises(LladaError, match="not a results row"):
        merge(out)
    assert not out.exists()


def test_merge_refuses_parts_of_different_settings(tmp_path):
    out = tmp_path / "gsm8k.jsonl"
    write_part(out, 0, 2, [0, 2], run={"suite": "gsm8k", "steps": 8})
    write_part(out, 1, 2, [1, 3], run={"suite": "gsm8k", "steps": 16})
    with pytest.raises(LladaError, match="another run setting"):
        merge(out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llada(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llada_jax.cli", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return out


@pytest.mark.slow
def test_two_hosts_through_jax_distributed_score_as_one(char_model_dir, tmp_path):  # noqa: F811
    """Two processes join one jax.distributed run (coordinator on 127.0.0.1), each with two simulated devices
    and its batches split over them; the merged parts equal a one-host, one-device run row for row."""
    run = ["eval", "gsm8k", "--model", str(char_model_dir), "--chat", "--limit", "7", "--json", *TINY_RUN]
    alone = json.loads(finished(llada(*run, "--out", str(tmp_path / "alone.jsonl"))))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    coordinator = f"127.0.0.1:{free_port()}"
    hosts = [llada(*run, "--out", str(tmp_path / "split.jsonl"), "--mesh", "data=2", "--hosts", "2",
                   "--coordinator", coordinator, "--host-id", str(host), env=env) for host in (0, 1)]
    shares = [json.loads(finished(host)) for host in hosts]
    assert [(share["host"], share["hosts"], share["problems"]) for share in shares] == [(0, 2, 4), (1, 2, 3)]
    merged = json.loads(finished(llada("eval", "merge", str(tmp_path / "split.jsonl"), "--json")))
    assert {key: merged[key] for key in ("accuracy", "correct", "problems", "errors", "mean_nfe")} == \
        {key: alone[key] for key in ("accuracy", "correct", "problems", "errors", "mean_nfe")}
    fields = ("index", "prompt", "output", "extracted", "correct", "nfe")
    assert [[row[key] for key in fields] for row in read_rows(tmp_path / "split.jsonl")] == \
        [[row[key] for key in fields] for row in read_rows(tmp_path / "alone.jsonl")]


@pytest.mark.parametrize("stop", [None, signal.SIGINT, signal.SIGTERM])
def test_a_host_whose_peers_never_join_stops_in_one_line(tmp_path, stop):
    """jax.distributed's own wait ignores signals and ends in an abort with a stack dump; ours ends at
    --host-timeout, or at once on Ctrl-C/SIGTERM, in one line, and writes nothing."""
    run = ["eval", "gsm8k", "--limit", "2", *TINY_RUN, "--out", str(tmp_path / "r.jsonl"),
           "--hosts", "2", "--coordinator", f"127.0.0.1:{free_port()}", "--host-id", "0", "--host-timeout", "4"]
    host = llada(*run)
    if stop is not None:
        assert host.stderr.readline().startswith("waiting up to 4 s for every host to join through 127.0.0.1:")
        host.send_signal(stop)
    _, err = host.communicate(timeout=120)
    last = {None: "llada: error: not every host joined within 4 s (--host-timeout): start each host with the same "
                  "--hosts and --coordinator, and a --host-id of its own",
            signal.SIGINT: "llada: interrupted while waiting for the other hosts",
            signal.SIGTERM: "llada: interrupted (SIGTERM) while waiting for the other hosts"}[stop]
    assert err.splitlines()[-1] == last and "Check failure" not in err
    assert host.returncode == {None: 1, signal.SIGINT: 130, signal.SIGTERM: 143}[stop]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("flags", "message"), [
    (["--hosts", "2", "--out", "x.jsonl"], "--hosts N needs N >= 1, --coordinator HOST:PORT and --host-id I"),
    (["--hosts", "2", "--coordinator", "127.0.0.1:1", "--host-id", "2", "--out", "x.jsonl"], r"must be in \[0, 2\)"),
    (["--hosts", "two", "--out", "x.jsonl"], "--hosts takes auto or a number of hosts, got 'two'"),
    (["--hosts", "auto", "--host-id", "0", "--out", "x.jsonl"], "--hosts auto reads the coordinator"),
    (["--hosts", "2"], "--hosts needs --out"),
    (["--host-id", "1"], "--coordinator, --host-id and --host-timeout go with --hosts"),
    (["--host-timeout", "5"], "--coordinator, --host-id and --host-timeout go with --hosts"),
    *[(["--hosts", "2", "--coordinator", "127.0.0.1:1", "--host-id", "0", "--out", "x.jsonl", "--host-timeout", value],
       r"--host-timeout must be in \(0, 604800\] seconds") for value in ("0", "-1", "nan", "inf")],
    *[(["--hosts", "2", "--coordinator", address, "--host-id", "0", "--out", "x.jsonl"], "must be HOST:PORT")
      for address in ("bad", "host:abc", "localhost:-1", "localhost:99999", ":1234", "host:", "host:0", "host:٣٠٠٠")],
])
def test_bad_host_flags_are_one_line_errors_before_anything_starts(flags, message):
    from tests.test_gsm8k import run_cli

    with pytest.raises(LladaError, match=message):
        run_cli("--limit", "1", *flags)


def test_a_batch_size_below_one_is_refused_by_the_command_line(capsys):
    from tests.test_gsm8k import run_cli

    with pytest.raises(SystemExit):
        run_cli("--limit", "1", "--batch-size", "0")
    assert "--batch-size: must be >= 1, got 0" in capsys.readouterr().err
