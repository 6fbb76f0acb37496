"""`llada bench --reference`: the reference decoders run in a child process beside ours, on the same prompts.

The checkout given here is a stand-in with the reference's interface (`llada/generate.py` with
`LLaDAModelLM` and the three generate functions, torch imported by the child): its decoders are the
float64 numpy oracle of tests/reference.py, and `torch` is a small numpy shim on the child's PYTHONPATH.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from llada_jax.cli import main

REPO = Path(__file__).resolve().parents[1]

FAKE_GENERATE = f"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
import numpy as np
from llada_jax.model.config import read_config
from tests import reference
from tests.conftest import read_all


class LLaDAModelLM:
    @classmethod
    def from_pretrained(cls, path, torch_dtype=None):
        slow_once = os.environ.get("FAKE_REFERENCE_SLOW_ONCE")  # the first run of the child is slower
        cls.delay = 0.0
        if slow_once and not os.path.exists(slow_once):
            Path(slow_once).touch()
            cls.delay = 0.1
        if os.environ.get("FAKE_REFERENCE_FAIL"):
            raise OSError("no model here")
        print("loading the reference model")  # the reference's own output on stdout is not an answer,
        print('{{"policy": "its own JSON"}}')  # even when it is JSON
        model = cls()
        model.weights, model.config = read_all(Path(path)), read_config(Path(path))
        return model

    def eval(self):
        return self

    def __call__(self, ids):
        self.widths = getattr(self, "widths", []) + [np.asarray(ids).shape[1]]
        assert np.asarray(ids).shape[0] == 1 and np.asarray(ids).max() < self.config.mask_token_id


def decoder(policy):
    def run(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold):
        assert temperature == 0.0 and remasking == "low_confidence" and mask_id == model.config.mask_token_id
        ids = np.asarray(prompt)[0]
        time.sleep(model.delay)
        answer, nfe = reference.generate(model.weights, model.config, ids, gen_length, block_length, steps,
                                         policy, threshold)
        answer = (answer + int(os.environ.get("FAKE_REFERENCE_SHIFT", "0"))) % mask_id
        return np.concatenate([ids, answer])[None], nfe
    return run


generate = decoder("vanilla")
generate_with_prefix_cache = decoder("prefix-cache")
generate_with_dual_cache = decoder("dual-cache")
"""

FAKE_TORCH = """
import numpy as np
float32, bfloat16 = "float32", "bfloat16"
class no_grad:
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
def set_num_threads(count):
    assert count >= 1
def tensor(rows):
    return np.asarray(rows)
"""


@pytest.fixture
def fake_reference(tmp_path, monkeypatch) -> Path:
    checkout = tmp_path / "Fast-dLLM"
    (checkout / "llada").mkdir(parents=True)
    (checkout / "llada" / "generate.py").write_text(textwrap.dedent(FAKE_GENERATE))
    (tmp_path / "shim" / "torch").mkdir(parents=True)
    (tmp_path / "shim" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "shim"))  # the child's only
    return checkout


def bench_rows(capsys, tiny_dir, checkout, *policies) -> tuple[int, list[dict], str]:
    args = ["bench", "--model", str(tiny_dir), "--limit", "2", "--gen-length", "16", "--steps", "16", "--json",
            "--reference", str(checkout)]
    code = main(args + [flag for policy in policies for flag in ("--policy", policy)])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else [], err


@pytest.mark.slow
def test_reference_rows_time_the_same_answers(capsys, tiny_dir, fake_reference):
    code, rows, _ = bench_rows(capsys, tiny_dir, fake_reference, "vanilla", "prefix-cache@0.3", "dual-cache@0.9",
                            "dual-cache+speculative@0.9")
    assert code == 0 and [row["setting"] for row in rows][-1] == "dual-cache+speculative@0.9"
    for row in rows[:3]:
        assert row["same_tokens"] == 1.0  # the oracle's answers, token for token
        assert row["ref_latency_s"] > 0 and row["speedup_vs_reference"] == pytest.approx(
            row["ref_latency_s"] / row["median_latency_s"])
    assert "ref_latency_s" not in rows[3]  # speculation has no reference decoder
    assert all("answers" not in row and "setting_key" not in row for row in rows)


@pytest.mark.slow
def test_the_reference_runs_before_and_after_ours_and_keeps_its_faster_time(capsys, tiny_dir, fake_reference,
                                                                           monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_REFERENCE_SLOW_ONCE", str(tmp_path / "ran"))  # the pass before ours: +0.1 s an answer
    code, rows, err = bench_rows(capsys, tiny_dir, fake_reference, "dual-cache")
    timed = {}
    for line in err.splitlines():
        if line.startswith("reference (") and " dual-cache prompt " in line:
            when, prompt_seconds = line.removeprefix("reference (").split(") dual-cache prompt ")
            prompt, seconds = prompt_seconds.removesuffix(" s").split(": ")
            timed.setdefault(int(prompt), {})[when] = float(seconds)
    assert code == 0 and sorted(timed) == [0, 1]
    assert all(passes["before ours"] > passes["after ours"] + 0.05 for passes in timed.values())
    fastest = sorted(min(passes.values()) for passes in timed.values())
    assert rows[0]["ref_latency_s"] == pytest.approx(sum(fastest) / 2, abs=0.006)  # the median of 2 prompts


@pytest.mark.slow
def test_different_reference_tokens_are_reported(capsys, tiny_dir, fake_reference, monkeypatch):
    monkeypatch.setenv("FAKE_REFERENCE_SHIFT", "1")
    code, rows, _ = bench_rows(capsys, tiny_dir, fake_reference, "dual-cache")
    assert code == 0 and rows[0]["same_tokens"] == 0.0


def test_reference_failures_are_one_line(capsys, tiny_dir, fake_reference, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_REFERENCE_FAIL", "1")
    code, _, err = bench_rows(capsys, tiny_dir, fake_reference, "vanilla")
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last == "llada: error: the reference decoders failed (exit 1): OSError: no model here"
    for checkout, extra, message in (
            (tmp_path, [], "no llada/generate.py there"),
            (fake_reference, ["--reference-python", str(tmp_path / "nothing")], "not an executable file"),
            (fake_reference, ["--policy", "dual-cache+speculative"], "none of the --policy settings")):
        assert main(["bench", "--model", str(tiny_dir), "--reference", str(checkout)] + extra) == 1
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_scale_bench_times_the_reference_model_on_the_float_checkpoint(capsys, tiny_dir, fake_reference):
    """A reference row beside ours: load, first call, a forward per canvas the model holds, its own peak RSS;
    a checkout that is not one is refused before anything is measured."""
    from eval import bench_scale
    bench_scale.main(["--setting", f"xla={tiny_dir}", "--reference", str(fake_reference), "--json"])
    ours, theirs = json.loads(capsys.readouterr().out)["rows"]
    assert (theirs["setting"], theirs["mode"]) == ("reference", "torch bfloat16") and "error" not in theirs
    assert set(ours) >= {"forward_s_32", "first_s"} and "forward_s_160" not in theirs  # the tiny model: 128 at most
    assert theirs["forward_s_32"] >= 0 and theirs["first_s"] >= theirs["load_s"] >= 0 and theirs["peak_rss_bytes"] > 0
    assert theirs["weight_bytes"] == sum(f.stat().st_size for f in tiny_dir.glob("*.safetensors"))
    with pytest.raises(SystemExit):
        bench_scale.main(["--setting", f"xla={tiny_dir}", "--reference", str(tiny_dir)])
    assert "no llada/generate.py there" in capsys.readouterr().err
