"""Nothing the user has is deleted or overwritten: every command that writes a directory or a file refuses an
existing target that is not its own earlier output, and any target that is or holds one of its inputs; with
--force it replaces only its own earlier output. Each refusal is one line and leaves every byte in place."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import pytest

from eval.jsonl import RowWriter, finished_rows, read_rows
from eval.scale_checkpoint import main as scale_main
from llada_jax.cli import main
from llada_jax.system.atomic import MARKER, previous_output
from llada_jax.system.errors import LladaError
from llada_jax.training import train as training
from tests.conftest import write_checkpoint


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def user_dir(path: Path) -> Path:
    """A directory of the user's own: a notes file and a subfolder."""
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes\n")
    (path / "sub" / "data.bin").write_bytes(bytes(range(256)))
    return path


def refused(capsys, argv: list[str], expected: str) -> None:
    capsys.readouterr()  # what earlier commands printed
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.fixture
def model_in_folder(tmp_path) -> Path:
    """A tiny checkpoint inside a folder that also holds the user's other files."""
    folder = user_dir(tmp_path / "models")
    return write_checkpoint(folder / "tiny")


QUANTIZE = ["quantize", "--bits", "8", "--model", "{model}", "--out"]
COMPILE = ["compile", "--target", "host", "--max-len", "64", "--window", "16", "--model", "{model}", "--out"]
CONVERT = ["convert", "--model", "{model}", "--out"]


@pytest.mark.parametrize("command", [QUANTIZE, COMPILE, CONVERT], ids=["quantize", "compile", "convert"])
@pytest.mark.parametrize("target, expected", [
    ("unrelated", "not an output of this command"),
    ("parent", "contains this command's input"),
    ("input", "is this command's input"),
    ("inside", "is inside this command's input"),
])
def test_directory_writers_refuse_what_is_not_theirs(capsys, tmp_path, model_in_folder, command, target, expected):
    folder = model_in_folder.parent
    unrelated = user_dir(tmp_path / "unrelated")
    out = {"unrelated": unrelated, "parent": folder, "input": model_in_folder,
           "inside": model_in_folder / "bundle"}[target]
    before = snapshot(tmp_path)
    refused(capsys, [a.replace("{model}", str(model_in_folder)) for a in command] + [str(out)], expected)
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "unrelated"]  # no temporary left behind


def test_quantize_replaces_its_own_output_only_with_force(capsys, tmp_path, model_in_folder):
    argv = [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(tmp_path / "q8")]
    assert main(argv) == 0
    assert previous_output(tmp_path / "q8") == "llada quantize"
    first = snapshot(tmp_path / "q8")
    refused(capsys, argv, "pass --force to replace it")
    assert snapshot(tmp_path / "q8") == first
    assert main(argv + ["--force"]) == 0
    again, first_files = snapshot(tmp_path / "q8"), dict(first)
    del again[MARKER], first_files[MARKER]  # the marker's stamps are the new files' times
    assert again == first_files  # the same copy, written anew
    assert main(argv[:2] + ["4"] + argv[3:] + ["--force"]) == 0
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization_config"]
    assert snapshot(tmp_path / "q8") != first


@pytest.mark.parametrize("added", ["notes.txt", "mine/data.bin", "mine"])
def test_force_keeps_what_the_user_added_to_an_earlier_output(capsys, tmp_path, model_in_folder, added):
    """--force replaces an earlier output, not the notes or folders the user put into it since."""
    out = tmp_path / "q8"
    argv = [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(out)]
    assert main(argv) == 0
    path = out / added
    if added == "mine":
        path.mkdir()
    else:
        path.parent.mkdir(exist_ok=True)
        path.write_text("the user's")
    before = snapshot(tmp_path)
    refused(capsys, argv + ["--force"], f"also what it did not write ({added.split('/')[0]}")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("edit", ["rewrite", "append", "touch"])
def test_force_keeps_a_file_the_user_edited_in_an_earlier_output(capsys, tmp_path, model_in_folder, edit):
    """A file the command wrote and the user changed since (its size or modification time) is the user's now."""
    out = tmp_path / "q8"
    argv = [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(out)]
    assert main(argv) == 0
    config = out / "config.json"
    if edit == "rewrite":
        config.write_text(config.read_text().replace("{", "{ ", 1))
    elif edit == "append":
        config.write_text(config.read_text() + "\n")
    else:
        os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    before = snapshot(tmp_path)
    refused(capsys, argv + ["--force"], "with files changed since it wrote them (config.json)")
    assert snapshot(tmp_path) == before


def test_force_replaces_an_older_llada_output_only_where_the_new_output_covers_it(capsys, tmp_path,
                                                                                     model_in_folder):
    """An output of an older llada records no list of its files: --force replaces it when the new output has
    every path it holds, and refuses, changing nothing, when it holds anything else (known once the new output is
    written, so the refusal comes after the work)."""
    out = tmp_path / "q8"
    argv = [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(out)]
    assert main(argv) == 0
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({"command": marker["command"]}))  # as an older llada wrote it
    (out / "notes.txt").write_text("the user's")
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert main(argv + ["--force"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].endswith("also what it did not write (notes.txt); move that "
                                                             "out before --force replaces the output")
    assert snapshot(tmp_path) == before
    (out / "notes.txt").unlink()
    assert main(argv + ["--force"]) == 0
    assert json.loads((out / MARKER).read_text())["contents"] == marker["contents"]


def test_force_never_replaces_another_commands_output_or_the_users(capsys, tmp_path, model_in_folder):
    quantized = tmp_path / "q8"
    assert main([a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(quantized)]) == 0
    before = snapshot(tmp_path)
    # A checkpoint written by save_hf is not a quantize output: --force does not make it one.
    refused(capsys, [a.replace("{model}", str(quantized)) for a in COMPILE] + [str(model_in_folder), "--force"],
            "is an output of `save_hf`")
    unrelated = user_dir(tmp_path / "unrelated")
    before = snapshot(tmp_path)
    refused(capsys, [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(unrelated), "--force"],
            "not an output of this command")
    assert snapshot(tmp_path) == before


def test_an_empty_directory_or_a_new_path_is_written(tmp_path, model_in_folder):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        assert main([a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(out)]) == 0
        assert (out / "config.json").is_file() and (out / MARKER).is_file()


def test_a_file_where_a_directory_goes_is_refused(capsys, tmp_path, model_in_folder):
    target = tmp_path / "file"
    target.write_text("mine")
    refused(capsys, [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(target)],
            "exists and is not a directory")
    assert target.read_text() == "mine"


def test_a_link_or_an_unwritable_place_is_named_as_given(capsys, tmp_path, model_in_folder):
    """A link is refused as a link (whatever it points at is left alone); a place nothing can be written is named
    by --out, not by the hidden scratch sibling the write would have made."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    refused(capsys, [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + [str(tmp_path / "link")],
            f"{tmp_path / 'link'} is a symbolic link; refusing to write through or over it")
    refused(capsys, [a.replace("{model}", str(model_in_folder)) for a in QUANTIZE] + ["/proc/llada-out"],
            "cannot write /proc/llada-out: No such file or directory")
    assert not any((tmp_path / "real").iterdir())


@pytest.mark.parametrize("target, expected", [
    ("unrelated", "not an output of this command"),
    ("parent", "contains this command's input"),
])
def test_scale_checkpoint_refuses_before_writing(capsys, tmp_path, target, expected):
    from eval.scale_checkpoint import METADATA_DIR

    out = user_dir(tmp_path / "unrelated") if target == "unrelated" else METADATA_DIR.parent
    before = snapshot(out)
    assert scale_main(["--out", str(out), "--layers", "1"]) == 1
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err
    assert snapshot(out) == before


SETTINGS = training.TrainSettings(steps=1, batch=2, seq_len=96, warmup=1, checkpoint_every=1)
CONFIG = dataclasses.replace(training.embedded_model_config(d_model=32, n_layers=1), max_sequence_length=128)


@pytest.mark.slow
def test_training_export_refuses_what_is_not_its_own(capsys, tmp_path):
    run_dir = tmp_path / "work" / "run"
    training.train(run_dir, SETTINGS, CONFIG, progress=False)
    unrelated = user_dir(tmp_path / "unrelated")
    before = snapshot(tmp_path)
    for out, expected in [(unrelated, "not an output of this command"), (run_dir, "is this command's input"),
                          (run_dir.parent, "contains this command's input"),
                          (run_dir / "checkpoints" / "5", "is inside this command's input")]:
        refused(capsys, ["train", "--out", str(run_dir), "--export-to", str(out)], expected)
        assert snapshot(tmp_path) == before
    exported = tmp_path / "exported"
    assert main(["train", "--out", str(run_dir), "--export-to", str(exported)]) == 0
    refused(capsys, ["train", "--out", str(run_dir), "--export-to", str(exported)], "pass --force")
    assert main(["train", "--out", str(run_dir), "--export-to", str(exported), "--force"]) == 0
    assert previous_output(exported) == "llada train"


def test_training_refuses_a_folder_that_holds_no_run(tmp_path):
    folder = user_dir(tmp_path / "mine")
    before = snapshot(folder)
    with pytest.raises(LladaError, match="holds no training run"):
        training.train(folder, SETTINGS, CONFIG, progress=False)
    assert snapshot(folder) == before


# Files of the user's that look like results: rows with an index (but no run setting), a last line without its
# newline that is a whole object, a single such line.
LOOKALIKES = ['{"index": 0, "a": 1}\n{"index": 1, "b": 2}', '{"index": 7, "x": 1}', '{"index": 0, "a": 1}\n']


@pytest.mark.parametrize("text", ["a line of mine", "{\"a\": 1}\n{\"b\": 2}", "one\ntwo\n", *LOOKALIKES])
def test_results_files_never_take_over_the_users_file(tmp_path, text):
    notes = tmp_path / "notes.jsonl"
    notes.write_text(text)
    with pytest.raises(LladaError, match="not a results"):
        finished_rows(notes, "key", {0: "a"}, {"suite": "gsm8k"})  # what a resuming run reads first
    assert notes.read_text() == text


@pytest.mark.parametrize("text", LOOKALIKES)
def test_eval_never_appends_to_or_merges_over_a_users_file(capsys, tmp_path, text):
    notes = tmp_path / "notes.jsonl"
    notes.write_text(text)
    refused(capsys, ["eval", "merge", str(notes)], "not a results")
    refused(capsys, ["eval", "gsm8k", "--limit", "1", "--gen-length", "8", "--out", str(notes)], "not a results")
    assert notes.read_text() == text


def test_a_row_cut_by_a_kill_is_dropped_and_the_run_resumes(tmp_path):
    out = tmp_path / "results.jsonl"
    run = {"suite": "gsm8k"}
    with RowWriter(out) as writer:
        writer.write({"key": "a", "index": 0, "run": run})
    with open(out, "ab") as handle:
        handle.write(b'{"index": 1, "key": "b')  # killed mid-row
    whole = [{"index": 0, "key": "a", "run": run}]
    assert read_rows(out) == whole and not out.read_bytes().endswith(b"\n")  # reading alone changes nothing
    assert finished_rows(out, "key", {0: "a", 1: "b"}, run) == {0: whole[0]}  # a run resuming cuts it
    assert out.read_bytes().endswith(b"\n")


def test_eval_merge_never_replaces_a_file_of_the_users(capsys, tmp_path):
    out = tmp_path / "results.jsonl"
    run = {"suite": "gsm8k"}
    (tmp_path / "results-host0-of-1.jsonl").write_text(json.dumps({"index": 0, "run": run, "problems": 1}) + "\n")
    out.write_text("my own notes\n")
    refused(capsys, ["eval", "merge", str(out)], "not a results file")
    assert out.read_text() == "my own notes\n"


@pytest.mark.parametrize("command", ["trace", "bench"])
def test_pictures_are_never_drawn_over_a_file_of_the_users(capsys, tmp_path, tiny_dir, command):
    """Not a PNG, a PNG of someone else's, or notes that merely mention the command: none is replaced."""
    flag = "--out" if command == "trace" else "--plot"
    text = b"Software\0my camera, not llada-jax llada " + command.encode()
    chunk = struct.pack(">I", len(text)) + b"tEXt" + text + b"\0\0\0\0"
    for content in (b"\x89PNG\r\n\x1a\n my holiday", b"\x89PNG\r\n\x1a\n" + chunk + b"\0\0\0\0IEND\0\0\0\0",
                    f"my notes about llada-jax llada {command} runs\n".encode()):
        picture = tmp_path / "photo.png"
        picture.write_bytes(content)
        for extra in ([], ["--force"]):
            refused(capsys, [command, "--model", str(tiny_dir), flag, str(picture), *extra],
                    "not an output of this command")
            assert picture.read_bytes() == content


def test_trace_replaces_its_own_picture_only_with_force(capsys, tmp_path, tiny_dir):
    picture = tmp_path / "trace.png"
    argv = ["trace", "--model", str(tiny_dir), "--prompt-ids", "1,2", "--gen-length", "8", "--steps", "8",
            "--block-length", "8", "--out", str(picture)]
    assert main(argv) == 0
    first = picture.read_bytes()
    assert first.startswith(b"\x89PNG")
    refused(capsys, argv, "pass --force")
    picture.write_bytes(first[:-12])  # an earlier trace, cut short: --force draws it whole again
    assert main(argv + ["--force"]) == 0
    assert picture.read_bytes() == first


@pytest.mark.slow
def test_compile_refuses_its_own_earlier_bundle_without_force(capsys, tiny_dir, host_bundle):
    before = snapshot(host_bundle)
    refused(capsys, ["compile", "--target", "host", "--model", str(tiny_dir), "--out", str(host_bundle)],
            "pass --force to replace it")
    assert snapshot(host_bundle) == before and previous_output(host_bundle) == "llada compile"
