"""`llada bench`: several decoders over the same prompts in one process and one run.

Per decoder setting: median latency per answer, tokens/s, mean NFE, host time per forward pass (the wall
time outside the backend's step calls, or outside the compiled loop's one call, per pass), mean window utilisation,
accuracy (when the prompts have answers), latency ratios against `vanilla` and `prefix-cache` (if in
the run), revisions per answer, the revision side path's time per answer and the fraction of it
hidden behind the dense path (0 when it runs inline); achieved GFLOP/s and step efficiency `eff` against
this machine's matmul peak measured in the same run (model FLOPs the steps executed, padding included,
/ time / peak); and `xfloor`, the time against the floor: the FLOPs the decoder must run (real positions
only, padding excluded; the LM head only where the decoder reads predictions) / peak. The peak is sampled
before the first row and after each one, and the highest sample is the one used (`PeakSamples`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eval.figure_file import save_png
from eval.reference_bench import add_reference_columns, faster_pass
from eval.task_eval import BLOCK_LENGTH, GEN_LENGTH
from llada_jax.model.config import LLaDAConfig
from llada_jax.system.compilation import compile_clock
from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import answer_text
from policies.compiled_loop import loop_covers
from policies.registry import DecoderSetting, make_policy

# `llada bench --bench-size`: random weights where steps are compute-bound (issue #17's size), and its workload.
ENGINE_CONFIG = LLaDAConfig(d_model=1024, n_layers=12, n_heads=16, n_kv_heads=16, mlp_hidden_size=2816,
                            vocab_size=32768, embedding_size=32768, max_sequence_length=256, mask_token_id=32767,
                            eos_token_id=32766, eot_token_id=32765)
ENGINE_WORKLOAD = {"gen_length": 128, "block_length": 32, "steps": 128, "prompt_length": 64}


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: np.ndarray
    answer: str | None = None  # None: no accuracy (random-weights speed runs)
    score: Callable[[str, str], bool] | None = None  # (output_text, answer) -> correct


def matmul_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    """This machine's float32 matmul throughput through XLA (the roofline's peak)."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)), jnp.float32)
    product = jax.jit(lambda x: x @ x)
    product(a).block_until_ready()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        product(a).block_until_ready()
        times.append(time.perf_counter() - started)
    return 2 * size ** 3 / min(times) / 1e9


class PeakSamples:
    """The matmul peak sampled across a run. This machine's matmul speed moves within seconds (eight samples
    in a row in one process: 120-157 GFLOP/s), so a single sample taken in a slow moment lowers the floor and
    flatters `eff` and `xfloor`. Ratios use the highest sample: the fastest the machine was seen to go."""

    def __init__(self):
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(matmul_peak_gflops())

    @property
    def peak(self) -> float:
        return max(self.samples)


def step_flops(config, width: int, context: int, head_rows: int | None = None) -> float:
    """Model FLOPs of one step computing `width` positions that attend to `context` keys in all, with
    the LM head on `head_rows` of them (None: all). A sparse MoE layer counts its router and the experts each
    position is routed to (the active-parameter floor)."""
    d, h = config.d_model, config.mlp_hidden_size
    kv = config.n_kv_heads * config.head_dim
    mlp = 3 * d * h * config.experts_per_token + d * config.n_experts if config.n_experts else 3 * d * h
    per_token = 2 * (2 * d * d + 2 * d * kv + mlp)
    attention = 4 * context * d
    head_rows = width if head_rows is None else head_rows
    return config.n_layers * width * (per_token + attention) + 2 * head_rows * d * config.embedding_size


def generate_all(generate, prompts: list[Prompt], batch: int, options: dict) -> tuple[list, list[int], float]:
    """Every prompt's result, `batch` prompts per generate call; each one's canvas length without the
    answer (its batch's longest prompt: rows are left-padded to it); and the seconds the calls took."""
    results, canvases, seconds = [], [], 0.0
    for start in range(0, len(prompts), batch):
        chunk = [prompt.ids for prompt in prompts[start: start + batch]]
        began = time.perf_counter()
        results += generate(chunk, **options)
        seconds += time.perf_counter() - began
        canvases += [max(len(ids) for ids in chunk)] * len(chunk)
    return results, canvases, seconds


def setting_options(setting: DecoderSetting, loop: str, gen_length: int, block_length: int, steps: int) -> dict:
    return dict(gen_length=gen_length, block_length=block_length, steps=steps, policy=setting.policy,
                threshold=setting.threshold, loop=loop)


def run_setting(generate, config, setting: DecoderSetting, prompts: list[Prompt], tokenizer, steps: int,
                block_length: int = BLOCK_LENGTH, loop: str = "auto", label: str | None = None,
                gen_length: int = GEN_LENGTH, batch: int = 1) -> dict:
    options = setting_options(setting, loop, gen_length, block_length, steps)
    results, canvases, total = generate_all(generate, prompts, batch, options)
    flops, floor_flops, correct = 0.0, 0.0, []
    for prompt, result, canvas in zip(prompts, results, canvases):
        length = canvas + gen_length
        flops += sum(step_flops(config, r.shape_width, length if r.kind == "full" else length + r.shape_width,
                                r.head_rows) for r in result.trace)
        # The floor: real positions only (padding excluded), the LM head on the positions read out (the
        # block's masks: the predictions the rule uses).
        floor_flops += sum(step_flops(config, r.width, len(prompt.ids) + gen_length,
                                      r.width if r.read_rows is None else r.read_rows) for r in result.trace)
        if prompt.answer is not None and prompt.score is not None:
            correct.append(prompt.score(answer_text(tokenizer, result.output_ids, config), prompt.answer))
    side_seconds = [result.stats.get("side_seconds", 0.0) for result in results]
    side_waited = sum(result.stats.get("side_wait_seconds", 0.0) if result.stats.get("side_concurrent") else side
                      for result, side in zip(results, side_seconds))
    nfes = [result.nfe for result in results]
    call_seconds = sum(result.stats.get("step_call_seconds", 0.0) for result in results)
    return {"setting": label or str(setting), "setting_key": setting, "batch": batch,
            "answers": [result.output_ids.tolist() for result in results],
            "loop": "+".join(sorted({result.stats.get("loop", "host") for result in results})),
            "median_latency_s": statistics.median(result.wall_s for result in results), "total_s": total,
            "answers_per_s": len(prompts) / total, "tokens_per_s": gen_length * len(prompts) / total,
            "mean_nfe": float(np.mean(nfes)),
            "window_utilisation": float(np.mean([result.mean_utilisation for result in results])),
            "revisions_per_answer": float(np.mean([result.revisions for result in results])),
            "accuracy": float(np.mean(correct)) if correct else None, "achieved_gflops": flops / total / 1e9,
            # a batch row's step calls include waiting for the others: host time is reported unbatched only
            "host_ms_per_step": 1e3 * max(total - call_seconds, 0.0) / max(sum(nfes), 1) if batch == 1 else None,
            "floor_gflop": floor_flops / 1e9, "side_seconds_per_answer": float(np.mean(side_seconds)),
            "side_hidden_fraction": 1.0 - side_waited / sum(side_seconds) if sum(side_seconds) else None}


WARM_PASSES = 3  # at temperature 0 a pass repeats its shapes: a second pass compiles nothing


def warm_row(*args) -> dict:
    """`run_setting`'s row from a pass that compiled nothing: a pass that met shapes the warm-up did not (other
    prompt lengths, revision's side steps) is run again, and what it compiled is reported as `compile_s`."""
    compile_s = 0.0
    for _ in range(WARM_PASSES):
        with compile_clock() as clock:
            row = run_setting(*args)
        if clock.seconds == 0.0:
            return dict(row, compile_s=compile_s)
        compile_s += clock.seconds
    raise LladaError(f"{row['setting']}: every one of {WARM_PASSES} passes compiled new steps; no warm time to report")


def add_ratios(rows: list[dict], peak: float) -> None:
    by_name = {row["setting"]: row for row in rows}
    for row in rows:
        row["step_efficiency"] = row["achieved_gflops"] / peak
        floor_s = row.pop("floor_gflop") / peak
        row["times_floor"] = row["total_s"] / floor_s if floor_s > 0 else None
        for base in ("vanilla", "prefix-cache"):
            reference = by_name.get(base) or by_name.get(f"{base} [host]") or by_name.get(f"{base} [b=1]")
            if reference is not None:
                row[f"speedup_vs_{base}"] = reference["median_latency_s"] / row["median_latency_s"]


def bench(generate, config, tokenizer, settings: list[DecoderSetting], prompts: list[Prompt], steps: int,
          progress=None, block_length: int = BLOCK_LENGTH, loops: tuple[str, ...] = ("auto",),
          gen_length: int = GEN_LENGTH, batch_sizes: tuple[int, ...] = (1,), reference=None) -> dict:
    """Warm every setting once (compilation), then measure them all on the same prompts. `loops`: the
    decode loops to run each setting with ("host", "compiled", "auto"); with several, every row is
    labelled with its loop (a setting the compiled loop does not cover gets only its host row).
    `batch_sizes`: prompts per generate call (a batch runs the host loop); with several, a row per size.
    `reference(label)`: runs the reference decoders on the same prompts and returns their answers
    (`eval.reference_bench`); it runs before ours and after, and each answer keeps its faster time."""
    passes = [reference(" (before ours)")] if reference else []
    runs = [(setting, loop, batch) for setting in settings for loop in loops for batch in batch_sizes
            if (loop != "compiled" or len(loops) == 1 or loop_covers(make_policy(setting.policy)))
            and (batch == 1 or loop != "compiled")]
    for setting, loop, batch in runs:
        generate_all(generate, prompts[:batch], batch, setting_options(setting, loop, gen_length, block_length, steps))
    rows, peaks = [], PeakSamples()
    peaks.sample()
    for setting, loop, batch in runs:
        label = (str(setting) + (f" [{loop}]" if len(loops) > 1 else "")
                 + (f" [b={batch}]" if len(batch_sizes) > 1 else ""))
        if progress:
            progress(f"bench {label} over {len(prompts)} prompts")
        rows.append(warm_row(generate, config, setting, prompts, tokenizer, steps, block_length, loop, label,
                             gen_length, batch))
        peaks.sample()
    single = {(setting, loop): row for (setting, loop, batch), row in zip(runs, rows) if batch == 1}
    for (setting, loop, batch), row in zip(runs, rows):
        if (setting, loop) in single:
            row["batch_gain"] = row["answers_per_s"] / single[setting, loop]["answers_per_s"]
    add_ratios(rows, peaks.peak)
    if reference:
        add_reference_columns(rows, faster_pass(passes + [reference(" (after ours)")]))
    for row in rows:
        del row["setting_key"], row["answers"]
    return {"peak_gflops": peaks.peak, "peak_samples": peaks.samples, "prompts": len(prompts),
            "gen_length": gen_length, "block_length": block_length, "steps": steps, "rows": rows}


TABLE = [  # (field, header, width, decimals)
    ("setting", "setting", 40, None), ("loop", "loop", 8, None), ("median_latency_s", "lat(s)", 8, 4),
    ("answers_per_s", "ans/s", 7, 2), ("batch_gain", "x/b1", 5, 2), ("mesh_gain", "x/1dev", 6, 2),
    ("tokens_per_s", "tok/s", 7, 0),
    ("mean_nfe", "NFE", 6, 1), ("window_utilisation", "util", 5, 2), ("accuracy", "acc", 6, 3),
    ("revisions_per_answer", "rev", 5, 2), ("side_seconds_per_answer", "side(s)", 8, 4),
    ("side_hidden_fraction", "hidden", 6, 2), ("speedup_vs_vanilla", "x/van", 6, 2),
    ("speedup_vs_prefix-cache", "x/pfx", 6, 2), ("achieved_gflops", "GFLOP/s", 8, 1),
    ("host_ms_per_step", "host(ms)", 8, 3),
    ("step_efficiency", "eff", 6, 3), ("times_floor", "xfloor", 7, 2), ("ref_latency_s", "ref(s)", 8, 3),
    ("speedup_vs_reference", "x/ref", 6, 2), ("same_tokens", "same", 5, 2), ("compile_s", "compile(s)", 10, 2),
]


def format_table(report: dict) -> str:
    def cell(value, width, decimals):
        if decimals is None:
            return str(value).ljust(width)
        return (" " * width) if value is None else f"{value:>{width}.{decimals}f}"

    lines = [" ".join(header.ljust(w) if d is None else header.rjust(w) for _, header, w, d in TABLE)]
    lines += [" ".join(cell(row.get(field), w, d) for field, _, w, d in TABLE) for row in report["rows"]]
    samples = report["peak_samples"]
    lines.append(f"matmul peak {report['peak_gflops']:.1f} GFLOP/s (highest of {len(samples)} samples across the "
                 f"run, lowest {min(samples):.1f}); {report['prompts']} prompts; "
                 f"gen {report['gen_length']}, block {report['block_length']}, steps {report['steps']}")
    return "\n".join(lines)


def plot(report: dict, path, force: bool = False) -> None:
    """Latency against accuracy, one point per decoder setting."""
    import matplotlib  # heavy (~0.4 s) and only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for row in report["rows"]:
        accuracy = row["accuracy"] if row["accuracy"] is not None else 0.0
        axes.scatter(row["median_latency_s"] * 1e3, accuracy)
        axes.annotate(row["setting"], (row["median_latency_s"] * 1e3, accuracy), fontsize=7,
                      xytext=(4, 2), textcoords="offset points")
    axes.set_xscale("log")
    axes.set_xlabel("median latency per answer (ms, log)")
    axes.set_ylabel("exact-match accuracy")
    axes.set_title("decoders: latency vs accuracy")
    figure.tight_layout()
    figure.set_dpi(120)
    save_png(figure, path, "llada bench", force)
    plt.close(figure)
