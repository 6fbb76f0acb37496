"""`llada bench` and `llada trace` produce their table, JSON rows, ratios and pictures."""

from __future__ import annotations

import json

import pytest

import eval.bench as eval_bench
from eval.bench import step_flops
from llada_jax.cli import main
from tests.conftest import TINY


@pytest.mark.slow
def test_bench_rows_ratios_and_plot(capsys, tiny_dir, tmp_path):
    plot = tmp_path / "bench.png"
    code = main(["bench", "--model", str(tiny_dir), "--limit", "2", "--policy", "vanilla", "--policy",
                 "prefix-cache", "--policy", "dual-cache+speculative@0.5", "--json", "--plot", str(plot)])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["setting"] for r in rows] == ["vanilla", "prefix-cache", "dual-cache+speculative@0.5"]
    assert rows[0]["speedup_vs_vanilla"] == 1.0 and rows[1]["speedup_vs_prefix-cache"] == 1.0
    assert rows[0]["mean_nfe"] == 32.0 and rows[2]["mean_nfe"] < 32.0
    assert rows[0]["accuracy"] is None  # no tokenizer: a speed run
    assert all(0 < r["window_utilisation"] <= 1 and 0 < r["step_efficiency"] for r in rows)
    # The floor counts real positions only, so it is never above what the padded steps executed.
    assert all(r["times_floor"] * r["step_efficiency"] >= 1 - 1e-9 for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(r["host_ms_per_step"] >= 0 for r in rows)


@pytest.mark.slow
def test_bench_loop_both_gives_a_host_and_a_compiled_row(capsys, tiny_dir):
    code = main(["bench", "--model", str(tiny_dir), "--limit", "2", "--policy", "dual-cache@0.5", "--policy",
                 "dual-cache+revision", "--loop", "both", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and [(r["setting"], r["loop"]) for r in rows] == [
        ("dual-cache@0.5 [host]", "host"), ("dual-cache@0.5 [compiled]", "compiled"),
        ("dual-cache+revision [host]", "host")]  # revision runs only on the host loop
    assert rows[0]["mean_nfe"] == rows[1]["mean_nfe"]


def test_ratios_use_the_highest_peak_sampled_around_every_row(capsys, monkeypatch, tiny_dir):
    """The peak is sampled before the first row and after each, and eff / xfloor use the highest sample."""
    from eval import bench
    samples = iter([120.0, 150.0, 90.0])
    monkeypatch.setattr(bench, "matmul_peak_gflops", lambda: next(samples))
    code = main(["bench", "--model", str(tiny_dir), "--limit", "1", "--policy", "vanilla", "--policy",
                 "dual-cache", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and next(samples, None) is None  # one sample before the rows, one after each of the two
    assert [r["achieved_gflops"] / r["step_efficiency"] for r in rows] == pytest.approx([150.0, 150.0])
    report = {"peak_gflops": 150.0, "peak_samples": [120.0, 150.0, 90.0], "prompts": 1, "gen_length": 32,
              "block_length": 8, "steps": 32, "rows": []}
    assert "matmul peak 150.0 GFLOP/s (highest of 3 samples across the run, lowest 90.0)" in bench.format_table(report)


def test_step_flops_counts_matmuls_and_attention():
    one = step_flops(TINY, width=1, context=1)
    assert step_flops(TINY, width=8, context=1) == 8 * one
    assert step_flops(TINY, width=1, context=11) - one == TINY.n_layers * 4 * 10 * TINY.d_model
    head = 2 * TINY.d_model * TINY.embedding_size  # per row the LM head runs on
    assert step_flops(TINY, width=8, context=1, head_rows=3) == 8 * one - 5 * head


def test_bench_rows_counts_the_step_projections():
    """eval.bench_rows's FLOPs are the projections' part of step_flops (no attention, no LM head), and its
    projections give the same activations in both layouts of llada_jax.model.layout."""
    import jax.numpy as jnp

    from eval import bench_rows
    from llada_jax.model.layout import Features, Positions

    no_attention_one_row = step_flops(TINY, width=1, context=0, head_rows=0)
    assert bench_rows.flops(TINY, 5) == 5 * no_attention_one_row
    layers = bench_rows.random_layers(TINY)
    x = jnp.linspace(-1.0, 1.0, 3 * TINY.d_model).reshape(1, 3, TINY.d_model)
    by_position = bench_rows.projections(layers, x, Positions)
    by_feature = Features.leave(bench_rows.projections(layers, Features.enter(x), Features), 1, 3)
    assert by_position.shape == x.shape and jnp.allclose(by_position, by_feature, atol=1e-5)
    with pytest.raises(SystemExit):
        bench_rows.main(["--rows", "0"])


def test_trace_picture(capsys, tiny_dir, tmp_path):
    out = tmp_path / "trace.png"
    code = main(["trace", "--model", str(tiny_dir), "--prompt-ids", "1,2,3", "--gen-length", "16", "--steps", "8",
                 "--policy", "dual-cache+speculative+revision:0.3", "--out", str(out)])
    assert code == 0 and out.read_bytes()[:4] == b"\x89PNG"
    assert "trace of" in capsys.readouterr().out


def test_non_positive_limits_are_one_line_errors(capsys, tiny_dir):
    for command in (["bench", "--model", str(tiny_dir), "--limit", "-1"], ["eval", "tasks", "--limit", "0"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err.startswith("llada: error: --limit must be") and err.count("\n") == 1
    for flag in ("--gen-length", "--steps", "--block-length", "--prompt-length"):
        assert main(["bench", "--model", str(tiny_dir), flag, "0"]) == 1
        err = capsys.readouterr().err
        assert err == f"llada: error: {flag} must be positive, got 0\n"


def test_block_length_that_does_not_divide_the_answer_is_a_one_line_error(capsys, tiny_dir):
    for command, message in ((["bench", "--model", str(tiny_dir), "--limit", "1", "--block-length", "5"],
                              "llada: error: gen_length=32 is not a multiple of block_length=5"),
                             (["eval", "tasks", "--limit", "1", "--block-length", "5"],
                              "llada: error: --block-length must divide the answer length 32")):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1


def test_a_row_is_timed_on_a_pass_that_compiled_nothing(monkeypatch):
    """A pass that met shapes the warm-up did not is run again; what it compiled is its own column."""
    import jax
    import jax.numpy as jnp

    passes = []

    def fake_run_setting(*args):
        if not passes:
            jax.jit(lambda x: x * 3 + 1)(jnp.arange(7)).block_until_ready()  # a shape first met while timed
        passes.append(args)
        return {"setting": "fake", "total_s": float(len(passes))}

    monkeypatch.setattr(eval_bench, "run_setting", fake_run_setting)
    row = eval_bench.warm_row("a", "b")
    assert len(passes) == 2 and row["total_s"] == 2.0 and row["compile_s"] > 0


@pytest.mark.slow
def test_scale_bench_rows_for_a_checkpoint_a_bundle_and_a_peer(capsys, tiny_dir, host_bundle, tmp_path):
    """Each row in its own process: XLA on the checkpoint, IREE on the bundle (only the canvases the model and
    the bundle's --max-len hold; for IREE its allocator's peak too), and a peer row parsed from llama-bench's
    JSON lines (a stand-in script here, printing what llama-bench prints for `-p 32,160 -n 0 -o jsonl`)."""
    from eval import bench_scale
    peer = tmp_path / "llama-bench"
    peer.write_text("#!/bin/sh\necho 'build: 0c1e570'\n" + "".join(
        f"echo '{{\"n_prompt\": {n}, \"n_gen\": 0, \"avg_ns\": {n}000000, \"stddev_ns\": 1}}'\n" for n in (32, 160)))
    peer.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    bench_scale.main(["--setting", f"xla={tiny_dir}", "--setting", f"iree={host_bundle}", "--llama-bench", str(peer),
                      "--gguf", f"peer={gguf}", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert not [row for row in report["rows"] if "error" in row], report["rows"]
    xla, iree, peer_row = report["rows"]
    assert report["cpu"] and (xla["mode"], iree["mode"], peer_row["mode"]) == ("resident", "IREE bundle", "llama.cpp")
    assert xla["forward_s_32"] > 0 and "forward_s_160" not in xla and "device_peak_bytes" not in xla  # 128 at most
    assert iree["forward_s_32"] > 0 and "forward_s_160" not in iree and iree["device_peak_bytes"] > 0
    assert (peer_row["forward_s_32"], peer_row["forward_s_160"], peer_row["weight_bytes"]) == (0.032, 0.16, 64)
