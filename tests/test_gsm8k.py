"""GSM8K: answer extraction against every gold answer, the resumable results file, and `llada eval gsm8k`
end to end on a tiny random model with the character tokenizer."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from eval.gsm8k import BUNDLED_TEST as GSM8K_TEST
from eval.gsm8k import extract_answer, load_problems, prompt_text, same_number
from eval.jsonl import RowWriter, finished_rows, read_rows
from llada_jax.cli.evaluate import add_gsm8k
from llada_jax.system.errors import LladaError

TINY_RUN = ["--gen-length", "16", "--block-length", "8", "--steps", "8", "--policy", "vanilla"]


def write_char_model(out_dir: Path, context: int = 1024) -> Path:
    """A random 1-layer model with the character tokenizer and a `context`-token context (prompts are long)."""
    from llada_jax.model.params import init_params
    from llada_jax.training.train import embedded_model_config
    from llada_jax.weights import char_tokenizer
    from llada_jax.weights.checkpoint import save_hf

    config = dataclasses.replace(embedded_model_config(d_model=32, n_layers=1), max_sequence_length=context)
    tokenizer_dir = out_dir.parent / "tokenizer-files"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    char_tokenizer.write_tokenizer_files(tokenizer_dir)
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    files = {name: tokenizer_dir / name for name in names}
    return save_hf(init_params(config, std=0.5), config, out_dir, extra_files=files)


@pytest.fixture(scope="module")
def char_model_dir(tmp_path_factory) -> Path:
    return write_char_model(tmp_path_factory.mktemp("char-model") / "model")


def run_cli(*argv: str):
    parser = argparse.ArgumentParser()
    add_gsm8k(parser.add_subparsers())
    args = parser.parse_args(["gsm8k", *argv])
    return args.run(args)


def test_every_gold_answer_scores_as_correct():
    problems = load_problems()  # the bundled test split
    golds = [problem["answer"].rsplit("####", 1)[1].strip() for problem in problems]
    by_marker = sum(same_number(extract_answer(p["answer"]), gold) for p, gold in zip(problems, golds))
    # Without the "#### N" line the last number decides; "$" and thousands commas must not matter.
    reasoning = [p["answer"].rsplit("####", 1)[0] for p in problems]
    by_last_number = sum(same_number(extract_answer(f"{text}So the answer is ${int(gold.replace(',', '')):,}."), gold)
                         for text, gold in zip(reasoning, golds))
    assert len(problems) == 1319 and by_marker == 1319 and by_last_number == 1319
    assert "2,125" in golds  # golds written with thousands commas are among them


@pytest.mark.parametrize("text, expected", [
    ("She pays 3 + 4 = 7 dollars.\n#### 1,000", "1000"),
    ("#### 42\nThen 7 more people came.", "42"),
    ("It costs $18.", "18"),
    ("The 3 boxes hold 1,250 apples", "1250"),
    ("It fell to -3 degrees", "-3"),
    ("He saves 2.50 a day.", "2.50"),
    ("#### none given, but 12 then 5", "5"),
    ("no digits at all", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_numbers_compare_by_value():
    assert same_number("1,000", "1000.0") and same_number("$18", "18") and same_number("-3.50", "-3.5")
    assert not same_number("18", "18.5") and not same_number(None, "1") and not same_number("1.2.3", "1")


def test_few_shot_prompt_holds_solved_examples_then_the_question():
    shots = load_problems(GSM8K_TEST, limit=2)
    text = prompt_text("How many?", shots)
    assert text.startswith(f"Question: {shots[0]['question']}\nAnswer: {shots[0]['answer']}\n\n")
    assert f"Answer: {shots[1]['answer']}\n\n" in text and text.endswith("Question: How many?\nAnswer:")


def test_shots_without_train_data_is_an_error():
    with pytest.raises(LladaError, match="--shots 2 needs --train-data"):
        run_cli("--data", str(GSM8K_TEST), "--shots", "2")


def test_data_without_final_answer_is_an_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "just 5"}) + "\n")
    with pytest.raises(LladaError, match="problem 1 has no final '#### N' answer"):
        load_problems(bad)


def test_truncated_last_row_is_dropped_and_cut_from_the_file(tmp_path):
    path, run = tmp_path / "rows.jsonl", {"suite": "s"}
    rows = [{"index": 0, "key": "a", "run": run}, {"index": 1, "key": "b", "run": run}]
    with RowWriter(path) as writer:
        for row in rows:
            writer.write(row)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"index": 2, "ke')
    assert read_rows(path) == rows
    assert finished_rows(path, "key", {0: "a", 1: "b", 2: "c"}) == {0: rows[0], 1: rows[1]}
    assert path.read_bytes() == whole
    with pytest.raises(LladaError, match="row 1 was written for a different key"):
        finished_rows(path, "key", {0: "a", 1: "other"})


def test_corrupt_complete_row_is_an_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"index": 0, "run": {}}\nnot json\n{"index": 2, "run": {}}\n')
    with pytest.raises(LladaError, match="rows.jsonl:2: not a results row"):
        read_rows(path)


@pytest.mark.slow
def test_run_appends_rows_and_a_killed_run_resumes(char_model_dir, tmp_path, capsys):
    out = tmp_path / "gsm8k.jsonl"
    common = ["--model", str(char_model_dir), "--chat", "--out", str(out), *TINY_RUN]  # the bundled problems
    run_cli(*common, "--limit", "2", "--json")
    summary = json.loads(capsys.readouterr().out)
    first = read_rows(out)
    assert summary["problems"] == 2 and summary["mean_nfe"] == 8.0 and summary["tokens_per_s"] > 0
    assert [row["index"] for row in first] == [0, 1] and [row["gold"] for row in first] == ["18", "3"]
    assert first[0]["prompt"].startswith("<|startoftext|><|start_header_id|>user")
    assert first[0]["prompt"].endswith("Answer:<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # "Janet’s ducks": the character vocabulary has no ’, so problem 0 is scored wrong with the reason.
    assert summary["errors"] == 1 and first[0]["correct"] is False and first[0]["nfe"] == 0
    assert "no token for '’' (U+2019)" in first[0]["error"]
    for row in first[1:]:
        assert row["nfe"] == 8 and row["latency_s"] > 0 and isinstance(row["output"], str) and "error" not in row
        assert row["correct"] == same_number(row["extracted"], row["gold"])

    # Killed while writing row 1: the rerun keeps row 0 as it was and redoes rows 1 and 2, once each.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1][:40])
    run_cli(*common, "--limit", "3", "--json")
    summary = json.loads(capsys.readouterr().out)
    again = read_rows(out)
    assert [row["index"] for row in again] == [0, 1, 2] and again[0] == first[0]
    assert summary["problems"] == 3 and summary["correct"] == sum(row["correct"] for row in again)

    with pytest.raises(LladaError, match="written for a different prompt"):
        run_cli(*common, "--limit", "1", "--shots", "1", "--train-data", str(GSM8K_TEST))


def test_a_run_resumes_only_with_the_model_that_began_it(char_model_dir, tmp_path, capsys):
    """The rows' run setting names the model by its files, not its path: a copy resumes the run; other weights
    of the same shapes, or another dtype, are refused before any step (one score over two models is wrong)."""
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "gsm8k.jsonl"
    run_cli("--model", str(char_model_dir), "--out", str(out), *TINY_RUN, "--limit", "1", "--json")
    copy = shutil.copytree(char_model_dir, tmp_path / "copy")
    run_cli("--model", str(copy), "--out", str(out), *TINY_RUN, "--limit", "2", "--json")
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["problems"] == 2
    tensors = load_file(copy / "model.safetensors")
    tensors["model.transformer.ff_out.weight"][0, 0] += 1.0
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LladaError, match=r"row 0 was written with another setting \(model\); use a new --out file"):
        run_cli("--model", str(copy), "--out", str(out), *TINY_RUN, "--limit", "3")
    with pytest.raises(LladaError, match=r"another setting \(dtype\)"):
        run_cli("--model", str(char_model_dir), "--dtype", "bfloat16", "--out", str(out), *TINY_RUN, "--limit", "3")
    assert len(read_rows(out)) == 2


def test_prompts_too_long_for_the_context_are_refused_before_any_step_or_skipped(tmp_path, capsys):
    """Of the bundled split's first 6 problems, one (489 tokens) does not fit a 256-position model with its
    answer: the run is refused before any problem runs, or with --skip-too-long it is recorded as skipped and
    counted apart."""
    model = write_char_model(tmp_path / "model", context=256)
    out = tmp_path / "gsm8k.jsonl"
    common = ["--model", str(model), "--out", str(out), "--limit", "6", *TINY_RUN]
    refusal = r"^1 of 6 problems do not fit the model's context: the longest prompt \(489\)"
    with pytest.raises(LladaError, match=refusal):
        run_cli(*common)
    assert not out.exists()  # nothing ran, nothing written
    run_cli(*common, "--skip-too-long", "--json")
    summary = json.loads(capsys.readouterr().out)
    rows = read_rows(out)
    skipped = [row for row in rows if "skipped" in row]
    assert len(rows) == 6 and summary["skipped"] == len(skipped) == 1 and summary["problems"] == 5
    assert all("exceeds max_sequence_length=256" in row["skipped"] and row["correct"] is False for row in skipped)
    assert summary["correct"] == sum(row["correct"] for row in rows if "skipped" not in row)


@pytest.mark.parametrize("field, value", [("nfe", "abc"), ("correct", "yes"), ("latency_s", None), ("index", -1)])
def test_a_hand_edited_row_is_refused_before_a_run_resumes_on_it(tmp_path, field, value):
    path = tmp_path / "rows.jsonl"
    row = {"index": 0, "run": {"suite": "gsm8k"}, "correct": True, "nfe": 8, "latency_s": 0.5, field: value}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(LladaError, match=f"rows.jsonl:1: (field {field} holds|a results row's index)"):
        finished_rows(path, "prompt", {0: "p"}, {"suite": "gsm8k"})
    assert json.loads(path.read_text()) == row


@pytest.mark.parametrize("question", [None, 5, ["a"]])
def test_a_question_that_is_not_text_is_refused_not_asked_as_its_spelling(tmp_path, question):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": question, "answer": "so #### 3"}) + "\n")
    with pytest.raises(LladaError, match="data.jsonl:1: question must be text"):
        load_problems(data)


def test_a_run_with_nothing_scored_has_no_accuracy_and_errors_are_named(capsys):
    """All skipped: accuracy n/a (JSON null), not 0.000; prompts the vocabulary lacks are counted on the line."""
    from eval.gsm8k import summarize
    from llada_jax.cli.evaluate import print_gsm8k

    run = {"suite": "gsm8k", "shots": 0, "chat": False, "gen_length": 16, "block_length": 8, "steps": 8,
           "policy": "vanilla", "threshold": None}
    skipped = {"index": 0, "correct": False, "nfe": 0, "latency_s": 0.0, "skipped": "too long"}
    summary = summarize([skipped], run)
    assert summary["accuracy"] is None and summary["problems"] == 0
    print_gsm8k(summary, as_json=False)
    assert capsys.readouterr().out.startswith("accuracy n/a (0/0)")
    error = {"index": 1, "correct": False, "nfe": 0, "latency_s": 0.0, "error": "no token for '’'"}
    print_gsm8k(summarize([skipped, error], run), as_json=False)
    line = capsys.readouterr().out
    assert line.startswith("accuracy 0.000 (0/1)") and "errors 1 (text the vocabulary lacks: scored wrong)" in line
