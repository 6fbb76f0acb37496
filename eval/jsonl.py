"""Resumable JSONL results: every row is flushed and fsynced as it is written, so a run killed at any
moment leaves complete rows plus at most one truncated last line, which the next run drops (and says so).
One run writes a results file at a time (an exclusive lock), so no row is written twice. A results row is a
JSON object with an integer `index` first and the `run` setting it was made under: a file with any other
line is the user's, and no command reads on into it, appends to it or cuts it."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import sys
from pathlib import Path

from llada_jax.system.errors import LladaError
from llada_jax.weights.fingerprint import fingerprint


def read_rows(path: Path | None, cut_partial: bool = False) -> list[dict]:
    """The complete rows of results file `path` (none if it does not exist); a truncated last row is left
    out, and with `cut_partial` (a run about to append) cut off the file. A file that is not a results file
    is refused untouched: it is the user's, not this command's."""
    if path is None or not Path(path).exists():
        return []
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise LladaError(f"cannot read {path}: {err.strerror}") from None
    # Invariant: a row is complete iff its "\n" is on disk (it is the last byte each write adds).
    complete, tail = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1:]
    rows = [_results_row(line, number, path) for number, line in enumerate(complete.split(b"\n"), start=1)
            if line.strip()]
    if tail.strip() and not _partial_row(tail):
        raise LladaError(f"{path}: the last line is not a results row; not a results file (use a new --out file)")
    if tail and cut_partial:
        with open(path, "r+b") as handle:
            handle.truncate(len(complete))
        print(f"llada: {path}: dropped its last row, cut off by a killed run ({len(tail)} bytes); "
              "that problem runs again", file=sys.stderr)
    return rows


ROW_START = b'{"index": '  # how every row this module writes begins (rows are built with their index first)


def _partial_row(tail: bytes) -> bool:
    """A last line without its newline that a killed run left: the start of a row, cut short of valid JSON
    (a whole object there was written by someone else: this module writes a row and its newline at once)."""
    if not tail.startswith(ROW_START):
        return False
    try:
        json.loads(tail)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True
    return False


def _results_row(line: bytes, number: int, path) -> dict:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        row = None
    if not (isinstance(row, dict) and type(row.get("index")) is int and isinstance(row.get("run"), dict)):
        raise LladaError(f"{path}:{number}: not a results row; not a results file (use a new --out file)")
    if row["index"] < 0:
        raise LladaError(f"{path}:{number}: a results row's index is a problem's number, not {row['index']}")
    for name, kinds in ROW_FIELDS.items():
        if name in row and type(row[name]) not in kinds:
            raise LladaError(f"{path}:{number}: field {name} holds {row[name]!r}, not what llada wrote there "
                             "(edited?); fix or remove the row")
    if "problems" in row and row["problems"] < 1:
        raise LladaError(f"{path}:{number}: field problems holds {row['problems']}, not a number of problems")
    return row


# The fields a summary adds up, as the evaluations write them: an edited row would fail the summary.
ROW_FIELDS = {"correct": (bool,), "passed": (bool,), "nfe": (int,), "latency_s": (int, float), "problems": (int,)}


def check_results_file(path: Path, force: bool) -> None:
    """Refuse to replace `path` unless it is a results file (and `force`): the user's files stay theirs."""
    read_rows(path)
    if Path(path).exists() and not force:
        raise LladaError(f"{path} holds earlier results; pass --force to replace it")


def read_jsonl(path, required: tuple[str, ...]) -> list[dict]:
    """A data file (JSONL, or JSONL.gz): one object per non-blank line, each holding the `required` keys as text
    (a null question would be asked as "None")."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            lines = handle.read().split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise LladaError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise LladaError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        missing = [key for key in required if not isinstance(row, dict) or key not in row]
        if missing:
            raise LladaError(f"{path}:{number}: missing {', '.join(missing)}")
        not_text = [key for key in required if not isinstance(row[key], str)]
        if not_text:
            raise LladaError(f"{path}:{number}: {not_text[0]} must be text, got {row[not_text[0]]!r}")
        rows.append(row)
    return rows


class RowWriter:
    """Appends one JSON row per line; each row is on disk (flush + fsync) before `write` returns. It holds the
    file's lock from opening to closing: read the finished rows after opening it. A file it created and
    left empty is removed when it closes."""

    def __init__(self, path: Path | None):
        self.handle, self.path, self.created = None, path, False
        if path is None:
            return
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.created = not Path(path).exists()
            self.handle = open(path, "a", encoding="utf-8")
        except OSError as err:
            raise LladaError(f"cannot write {path}: {err.strerror}") from None
        try:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise LladaError(f"{path} is being written by another run; wait for it or use another --out file") from None

    def write(self, row: dict) -> None:
        if self.handle is None:
            return
        if type(row.get("index")) is not int or not isinstance(row.get("run"), dict):
            raise ValueError("a results row needs an integer index and its run setting")  # a defect, not input
        row = {"index": row["index"], **row}  # index first (ROW_START): a truncated row is recognisable as one
        self.handle.write(json.dumps(row) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        if self.handle is None:
            return
        if self.created and self.handle.tell() == 0 and self.path is not None:
            Path(self.path).unlink(missing_ok=True)  # ours, and nothing was written
        self.handle.close()
        self.handle = None

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_setting(suite: str, decoding: dict | None = None, **extra) -> dict:
    """What a results row was generated under (suite, model, decoder flags, shots, ...): rows of another
    setting never mix into a run's file. The decode loop is left out: the host and compiled loops give the same
    tokens."""
    return {"suite": suite, **extra, **{key: value for key, value in (decoding or {}).items() if key != "loop"}}


def model_setting(model) -> dict:
    """The model part of a run setting: its files' fingerprint (not its path: a copied checkpoint resumes) and
    how it computes."""
    return {"model": fingerprint(model.path) if model.path is not None else None, "dtype": model.dtype,
            "activations": model.activations, "kernels": model.kernels}


def finished_rows(path: Path | None, key: str, expected: dict, run: dict | None = None) -> dict:
    """Rows already in `path` by their `index`; a row whose `key` differs from `expected[index]`, or whose
    run setting (`run`, where the row has one) differs, means the file belongs to another run, which is an
    error (mixing them would corrupt the results)."""
    done = {}
    for row in read_rows(path, cut_partial=True):
        index = row.get("index")
        if index not in expected:
            continue
        if row.get(key) != expected[index]:
            raise LladaError(f"{path}: row {index} was written for a different {key}; use a new --out file")
        if run is not None and row.get("run", run) != run:
            changed = sorted(name for name in {*run, *row["run"]} if run.get(name) != row["run"].get(name))
            raise LladaError(f"{path}: row {index} was written with another setting ({', '.join(changed)}); "
                             "use a new --out file")
        done[index] = row
    return done
