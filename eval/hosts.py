"""An evaluation split over several hosts: host `index` of `count` takes every problem whose number is
`index` modulo `count` and appends its rows to its own part file (`OUT` -> `OUT-host2-of-4.jsonl`), resumable
as a one-host run's file is; `merge` then checks the parts cover every problem exactly once, under one run
setting, and writes them as the one results file a one-host run would have written.

Each row carries its run's setting (`run`: suite, decoding) and problem count, so a rerun or a merge refuses rows
of another run instead of mixing them."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from eval.jsonl import check_results_file, read_rows
from llada_jax.system.atomic import atomic_write_bytes
from llada_jax.system.errors import LladaError

_PART = re.compile(r"-host(\d+)-of-(\d+)$")


@dataclasses.dataclass(frozen=True)
class HostShare:
    """This host's share of the problems: number `index` of `count` hosts."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise LladaError(f"host {self.index} of {self.count}: the host index must be in [0, {self.count})")

    def owns(self, number: int) -> bool:
        return number % self.count == self.index

    def part(self, out: Path | None) -> Path | None:
        """This host's results file: `out` itself on a one-host run."""
        if out is None or self.count == 1:
            return out
        return out.with_name(f"{_stem(out)}-host{self.index}-of-{self.count}{out.suffix}")


def _stem(out: Path) -> str:
    return out.name[: -len(out.suffix)] if out.suffix else out.name


def part_files(out: Path) -> list[Path]:
    """The part files of `out`, one per host, all of one run's host count (any missing is an error)."""
    found: dict[int, dict[int, Path]] = {}
    for path in out.parent.glob(f"{_stem(out)}-host*-of-*{out.suffix}"):
        match = _PART.search(_stem(path))
        if match and _stem(path)[: match.start()] == _stem(out):
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    if not found:
        raise LladaError(f"no part files {_stem(out)}-hostI-of-N{out.suffix} next to {out}")
    if len(found) > 1:
        raise LladaError(f"part files of runs over {' and '.join(map(str, sorted(found)))} hosts sit next to {out}; "
                         "keep one run's")
    count, parts = next(iter(found.items()))
    stray = [index for index in parts if index >= count]
    if stray:
        raise LladaError(f"{parts[stray[0]]} names host {stray[0]} of {count}, and hosts count from 0")
    if len(parts) < count:  # the first missing host, found without listing every host of a huge count
        missing = next(index for index in range(count) if index not in parts)
        raise LladaError(f"{out}: no part file from host {missing} of {count} ({count - len(parts)} missing)")
    return [parts[index] for index in range(count)]


def merge(out: Path, force: bool = False) -> list[dict]:
    """Every part file's rows, checked (one run setting, each problem exactly once, none missing) and written
    to `out` in problem order (replacing only an earlier results file there, with `force`); the rows."""
    check_results_file(out, force)
    rows: dict[int, dict] = {}
    run = None
    for path in part_files(out):
        for row in read_rows(path):  # a results file's rows each hold an index and their run setting
            run = row["run"] if run is None else run
            if row["run"] != run:
                raise LladaError(f"{path}: row {row.get('index')} comes from another run setting than the other parts")
            if row.get("index") in rows:
                raise LladaError(f"{path}: problem {row.get('index')} is in two part files")
            rows[row["index"]] = row
    if not rows:
        raise LladaError(f"{out}: the part files hold no rows yet; run every host first")
    totals = {row.get("problems") for row in rows.values()}
    if len(totals) > 1:
        raise LladaError(f"{out}: the parts were run over different numbers of problems ({sorted(totals, key=str)}); "
                         "give every host the same --limit")
    total = totals.pop()
    total = len(rows) if total is None else total
    beyond = [index for index in rows if index >= total]
    if beyond:
        raise LladaError(f"{out}: a part holds problem {beyond[0]}, beyond the run's {total} problems")
    if len(rows) < total:  # the first missing problem, found without listing every problem of a huge count
        first = next(index for index in range(total) if index not in rows)
        raise LladaError(f"{out}: {total - len(rows)} of {total} problems have no row yet (first: {first}); "
                         "finish (or resume) every host first")
    ordered = [rows[index] for index in sorted(rows)]
    try:
        atomic_write_bytes(out, "".join(json.dumps(row) + "\n" for row in ordered).encode(), "llada eval merge")
    except OSError as err:
        raise LladaError(f"cannot write {out}: {err.strerror}") from None
    return ordered
