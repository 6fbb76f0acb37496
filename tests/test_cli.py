"""`llada generate`: JSON output, and a one-line error with a non-zero exit for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llada_jax.cli import main
from llada_jax.system.errors import LladaError
from tests.conftest import TINY

VALID = ["--prompt-ids", "1,2,3", "--gen-length", "16", "--block-length", "8", "--steps", "8", "--policy", "vanilla"]


def run(capsys, *args):
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output(capsys, tiny_dir):
    code, out, _ = run(capsys, "--model", str(tiny_dir), *VALID, "--json", "--policy", "dual-cache")
    row = json.loads(out)
    assert code == 0 and len(row["output_ids"]) == 16 and row["nfe"] == 8
    assert row["wall_s"] > 0 and row["tokens_per_s"] > 0 and "text" not in row  # no tokenizer.json


def replace(args, flag, value):
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


BAD_INPUTS = {
    "token id outside the vocab": (replace(VALID, "--prompt-ids", "1,512"), "outside the vocabulary [0, 512)"),
    "mask id in prompt": (replace(VALID, "--prompt-ids", f"1,{TINY.mask_token_id}"), "mask token id 500"),
    "negative token id": (replace(VALID, "--prompt-ids", "1,-3"), "outside the vocabulary"),
    "too long": (replace(replace(VALID, "--gen-length", "128"), "--steps", "128"), "exceeds max_sequence_length=128"),
    "block does not divide": (replace(VALID, "--block-length", "5"), "not a multiple of block_length=5"),
    "steps below blocks": (replace(VALID, "--steps", "1"), "fewer than the 2 blocks"),
    "steps do not divide": (replace(VALID, "--steps", "3"), "not divisible by the number of blocks"),
    "unknown policy": (replace(VALID, "--policy", "fastest"), "unknown policy 'fastest'"),
    "threshold zero": (replace(VALID, "--threshold", "0"), "threshold must be in (0, 1]"),
    "threshold above one": (replace(VALID, "--threshold", "1.5"), "threshold must be in (0, 1]"),
    "negative temperature": (replace(VALID, "--temperature", "-1"), "temperature must be >= 0"),
    "infinite temperature": (replace(VALID, "--temperature", "inf"), "temperature must be a finite number"),
    "unknown remasking": (replace(VALID, "--remasking", "lowest"), "unknown remasking"),
    "unknown dtype": (VALID + ["--dtype", "float8"], "unknown dtype"),
    "bad id list": (replace(VALID, "--prompt-ids", "1,x"), "comma-separated token ids"),
    "id list with a hole": (replace(VALID, "--prompt-ids", "1,,2"), "comma-separated token ids"),
    "id past int64": (replace(VALID, "--prompt-ids", "99999999999999999999"), "comma-separated token ids"),
    "text without tokenizer": (VALID[2:] + ["--prompt", "hi"], "no tokenizer.json"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_error(capsys, tiny_dir, case):
    args, expected = BAD_INPUTS[case]
    code, out, err = run(capsys, "--model", str(tiny_dir), *args)
    assert code == 1 and out == ""
    assert err.startswith("llada: error: ") and expected in err and err.count("\n") == 1


@pytest.mark.parametrize("model_dir, words", [("missing", "does not exist"), ("empty", "no model.safetensors"),
                                              ("file", "is a file, not a model directory")])
def test_missing_or_corrupt_model_dir(capsys, tmp_path, model_dir, words):
    path = tmp_path / model_dir
    if model_dir == "empty":
        path.mkdir()
        (path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    if model_dir == "file":
        path.write_text("not a directory")
    code, _, err = run(capsys, "--model", str(path), *VALID)
    assert code == 1 and err.count("\n") == 1 and words in err


@pytest.mark.parametrize("argv", [["generate", "--model", "", "hi"], ["generate", "--bundle", "", "hi"],
                                  ["quantize", "--out", "", "--bits", "4"],
                                  ["compile", "--out", "", "--target", "host"], ["train", "--out", ""],
                                  ["eval", "gsm8k", "--out", ""], ["serve", ""],
                                  ["eval", "humaneval", "--samples", ""], ["eval", "humaneval", "--data", ""],
                                  ["eval", "gsm8k", "--train-data", ""], ["generate", "--prompt-file", ""],
                                  ["bench", "--plot", ""], ["bench", "--reference", ""], ["bench", "--data", ""],
                                  ["train", "--out", "run", "--export-to", ""]])
def test_an_empty_path_is_refused_not_read_as_the_default_or_the_current_directory(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and "must name a path, got an empty string" in capsys.readouterr().err


def test_xla_runtime_error_is_one_line(capsys, tiny_dir, monkeypatch):
    """An allocation XLA refuses mid-generation is XLA's first line plus what would fit, not a traceback."""
    from jax.errors import JaxRuntimeError

    from llada_jax.cli import generate

    def out_of_memory(args):
        raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 30005501448 bytes.\nstack")

    monkeypatch.setattr(generate, "cmd_generate", out_of_memory)
    code, out, err = run(capsys, "--model", str(tiny_dir), *VALID)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("llada: error: RESOURCE_EXHAUSTED: Out of memory allocating 30005501448 bytes.")
    assert "--device-memory-budget" in err


@pytest.mark.slow
def test_real_process_exits_nonzero_without_traceback(tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "llada_jax.cli", "generate", "--model", str(tiny_dir),
                           *replace(VALID, "--prompt-ids", "999999")], capture_output=True, text=True,
                           check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("llada: error: prompt holds token id 999999")


@pytest.mark.parametrize("flags, spec", [
    ([], "dual-cache+speculative"),  # the default decoder (at threshold 0.9)
    (["--threshold", "0.7"], "dual-cache+speculative"),
    (["--policy", "vanilla"], "vanilla"),
    (["--policy", "dual-cache", "--lookahead", "2"], "dual-cache+speculative:2:0.9"),
    (["--policy", "dual-cache", "--draft-threshold", "0.8"], "dual-cache+speculative:3:0.8"),
    (["--policy", "dual-cache+speculative:1:0.8", "--lookahead", "3"], "dual-cache+speculative:3:0.8"),
    (["--policy", "prefix-cache", "--revise-threshold", "0.95", "--confirmations", "3"],
     "prefix-cache+revision:0.95:3"),
    (["--policy", "dual-cache", "--confirmations", "3"], "dual-cache+revision:0.5:3"),  # the documented default
    (["--policy", "dual-cache+speculative@0.7"], "dual-cache+speculative"),
])
def test_policy_flags_fold_into_the_spec(flags, spec):
    from llada_jax.cli import build_parser
    from llada_jax.cli.flags import policy_spec

    args = build_parser().parse_args(["generate", "--prompt-ids", "1", *flags])
    assert policy_spec(args) == spec


@pytest.mark.parametrize("flags, threshold", [
    ([], 0.9), (["--policy", "vanilla"], None), (["--threshold", "0.8"], 0.8), (["--policy", "dual-cache@0.7"], 0.7),
])
def test_commit_threshold_from_flag_or_policy(flags, threshold):
    from llada_jax.cli import build_parser
    from llada_jax.cli.flags import commit_threshold

    assert commit_threshold(build_parser().parse_args(["generate", "--prompt-ids", "1", *flags])) == threshold


@pytest.mark.parametrize("flags, message", [
    (["--policy", "dual-cache@0.7", "--threshold", "0.8"], "give the commit threshold once"),
    (["--policy", "dual-cache@high"], "bad threshold in --policy 'dual-cache@high'"),
])
def test_commit_threshold_errors(flags, message):
    from llada_jax.cli import build_parser
    from llada_jax.cli.flags import commit_threshold

    with pytest.raises(LladaError, match=message):
        commit_threshold(build_parser().parse_args(["generate", "--prompt-ids", "1", *flags]))


def test_policy_flags_reach_the_decoder(capsys, tiny_dir):
    code, out, _ = run(capsys, "--model", str(tiny_dir), *VALID, "--json", "--policy", "dual-cache",
                       "--lookahead", "1", "--draft-threshold", "0.01")
    assert code == 0 and json.loads(out)["nfe"] < 8  # drafts filled the second block early


@pytest.mark.parametrize("args, expected", [
    (["train", "--out", "{tmp}/run", "--steps", "0"], "training steps must be positive"),
    (["train", "--out", "{tmp}/run", "--block-aware", "2"], "block-aware in [0, 1]"),
    (["trace", "--prompt-ids", "1,2", "--gen-length", "8", "--steps", "8", "--out", "/proc/llada/x.png"],
     "llada: error:"),
])
def test_bad_training_settings_and_unwritable_outputs_are_one_line_errors(capsys, tmp_path, tiny_dir, args,
                                                                          expected):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if argv[0] == "trace":
        argv += ["--model", str(tiny_dir)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err


def test_default_decoder_is_the_fast_one_and_help_says_so(capsys):
    from llada_jax.cli import build_parser
    from llada_jax.cli.flags import DEFAULT_POLICY

    assert DEFAULT_POLICY == "dual-cache+speculative@0.9"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: dual-cache+speculative@0.9" in help_text and "vanilla is LLaDA's reference decoder" in help_text


@pytest.mark.slow
def test_a_new_process_reuses_compiled_steps(tmp_path):
    """XLA's persistent cache lives in the user's cache directory: the second process compiles nothing."""
    import os

    env = dict(os.environ, LLADA_CACHE=str(tmp_path / "cache"))
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "llada_jax.cli", "generate", "--json", "--chat", "sort 3 1 2"],
                              capture_output=True, text=True, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout)["compile"])
    assert runs[0]["steps"] > 0 and runs[0]["from_cache"] == 0
    assert runs[1]["steps"] == runs[0]["steps"] == runs[1]["from_cache"]
    assert any((tmp_path / "cache" / "xla").iterdir())


def test_live_canvas_hides_special_tokens_after_the_answer_ends():
    import io

    from llada_jax.cli.display import MASK_GLYPH, LiveCanvas
    from llada_jax.system.locations import default_model_dir
    from llada_jax.weights.tokenizer import load_tokenizer
    from policies.canvas import Canvas
    from policies.loop import StepRecord

    tokenizer = load_tokenizer(default_model_dir())
    eos, eot, mask = (tokenizer.token_id(t) for t in ("<|endoftext|>", "<|eot_id|>", "<|mdm_mask|>"))
    answer = tokenizer.encode("abc") + [eot, eos, eos] + tokenizer.encode("d") + [mask, eos]
    canvas = Canvas.start(np.array(tokenizer.encode("hi")), len(answer), mask, False, 64)
    canvas.write(np.arange(2, 2 + len(answer)), np.array(answer))
    stream = io.StringIO()
    LiveCanvas(tokenizer, (eos, eot), stream)(canvas, StepRecord(0, 0, "full", 8, 8, 8, (), (), ()))
    assert stream.getvalue().endswith(f"\n\nabcd{MASK_GLYPH}\n")
    stream = io.StringIO()
    LiveCanvas(tokenizer, (), stream)(canvas, StepRecord(0, 0, "full", 8, 8, 8, (), (), ()))
    assert "<|endoftext|>" in stream.getvalue()  # without end ids every token is drawn


@pytest.mark.parametrize("command", [["eval", "tasks"], ["bench", "--bench-size"]])
def test_a_bad_later_setting_stops_the_run_before_any_work(capsys, tmp_path, command):
    """The second --policy is refused before a model loads (or a bench checkpoint is written)."""
    code = main([*command, "--model", str(tmp_path / "absent"), "--policy", "vanilla", "--policy", "turbo@0.9"])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("llada: error: unknown policy 'turbo'") and err.count("\n") == 1


def test_prompt_file_answers_each_line_as_alone(capsys, tmp_path, tiny_dir):
    """Three prompts in batches of 2: an answer per line, in order, each as `--prompt-ids` alone gives it."""
    lines = ["1,2,3", "7,8,9,10,11", "4"]
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n\n")
    options = ["--gen-length", "16", "--block-length", "8", "--steps", "8", "--policy", "dual-cache", "--json"]
    code, out, _ = run(capsys, "--model", str(tiny_dir), "--prompt-file", str(tmp_path / "prompts.txt"), "--ids",
                       "--batch-size", "2", *options)
    assert code == 0
    answers = [json.loads(line)["output_ids"] for line in out.splitlines()]
    alone = [json.loads(run(capsys, "--model", str(tiny_dir), "--prompt-ids", ids, *options)[1])["output_ids"]
             for ids in lines]
    assert answers == alone


@pytest.mark.parametrize("content, args, expected", [
    ("1,2\n1,x\n", ["--ids"], "line 2 of"), ("\n\n", ["--ids"], "holds no prompt"),
    ("1,2\n\n1,99999\n", ["--ids"], "line 3 of prompts.txt holds token id 99999 outside the vocabulary"),
    ("1,2\n\n" + "7," * 250 + "7\n", ["--ids"], "line 3 of prompts.txt: prompt (251) + gen_length (16) = 267"),
    ("1,2\n", ["--ids", "--gen-length", "12"], "error: gen_length=12 is not a multiple of block_length=8"),
    ("1,2\n", ["--ids", "--batch-size", "0"], "--batch-size must be positive"),
    ("1,2\n", ["--ids", "--prompt-ids", "3"], "either --prompt-file or a prompt"),
])
def test_bad_prompt_files_are_one_line_errors(capsys, tmp_path, tiny_dir, monkeypatch, content, args, expected):
    (tmp_path / "prompts.txt").write_text(content)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--model", str(tiny_dir), "--prompt-file", "prompts.txt", "--gen-length", "16", *args,
                         "--block-length", "8", "--steps", "8")
    assert code == 1 and out == ""
    assert err.startswith("llada: error: ") and expected in err and err.count("\n") == 1


def test_version_and_help_show_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"llada {version('llada-jax')}"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "(default: 8000)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["eval", "gsm8k", "--help"])
    assert "(default: float32)" in " ".join(capsys.readouterr().out.split())


@given(count=st.integers(0, 10**15), unit=st.sampled_from(["", "B", "kB", "MB", "GB", "KiB", "MiB", "GiB"]))
def test_byte_counts_read_with_their_unit(count, unit):
    """`--device-memory-budget 2GB` is 2e9 bytes, `1.5GiB` 1.5 * 2**30: exact, whole bytes."""
    import argparse

    from llada_jax.cli.flags import BYTE_UNITS, byte_count

    assert byte_count(f"{count}{unit}") == count * BYTE_UNITS[unit.lower()]
    assert byte_count(f"{count / 4}GiB") == count * 2**28
    with pytest.raises(argparse.ArgumentTypeError):
        byte_count(f"{count}.5")  # half a byte


@pytest.mark.parametrize("command", ["compile", "generate"])
@pytest.mark.parametrize("text", ["abc", "-5", "2XB", "1e", "nan", "inf", "1e999999999", ""])
def test_a_bad_byte_count_is_a_usage_error(capsys, command, text):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--device-memory-budget", text])
    assert exit_.value.code == 2 and "expected a number of bytes" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("argv, words", [
    (["generate", "--prompt-ids", "1,2", "--chat"], "--chat wraps prompt text in the chat template"),
    (["generate", "--prompt-ids", "1,2", "--ids"], "--ids reads --prompt-file's lines as token ids"),
    (["trace", "--prompt-ids", "1,2", "--chat", "--out", "never.png"], "--chat wraps prompt text"),
    (["trace", "--out", "never.png"], "give exactly one of a prompt text"),
])
def test_prompt_flags_that_would_be_ignored_are_refused_before_the_model_loads(capsys, monkeypatch, tmp_path, argv,
                                                                              words):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("llada_jax.cli.generate.generation_runner", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("llada: error: ") and words in err and err.count("\n") == 1
    assert not (tmp_path / "never.png").exists()


def test_generated_text_ends_at_the_first_end_of_text_as_the_server_answers(capsys):
    """What the canvas holds after EOS/EoT is padding, not answer: the printed text stops there (the ids are all
    printed), here where the tokens after the first EOS would decode to text."""
    import llada_jax
    from llada_jax.system.locations import EMBEDDED_DIR
    from llada_jax.weights.tokenizer import answer_text

    code, out, _ = run(capsys, "<|eot_id|>", "--json")
    row, model = json.loads(out), llada_jax.load(EMBEDDED_DIR)
    assert code == 0 and row["text"] == answer_text(model.tokenizer, row["output_ids"], model.config)
    assert row["text"] != model.tokenizer.decode(row["output_ids"])


def test_a_prompt_file_line_the_tokenizer_refuses_is_named(capsys, tmp_path, monkeypatch):
    (tmp_path / "prompts.txt").write_text("ok\n\ncafé ✓\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--prompt-file", "prompts.txt")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("llada: error: line 3 of prompts.txt: the model's vocabulary has no token for")
