"""Benchmark: IREE host step time against the XLA step time for the same shapes, and end-to-end
generation through both, measured in one run. Medians over repeated calls; nothing is asserted.

    python -m eval.bench_lowering                      # the embedded model
    python -m eval.bench_lowering --bench-size         # random weights, d_model 1024, 126464 vocab
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import llada_jax
from llada_jax.backends.iree import IreeBackend, Session, load_bundle
from llada_jax.backends.select import OpenBundle
from llada_jax.backends.xla import JaxBackend
from llada_jax.bundle_runner import generate_with_bundle
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.params import init_params
from llada_jax.model.readout import ReadoutSpec, TokenBiases
from llada_jax.system.atomic import write_once
from llada_jax.system.locations import default_model_dir, user_cache_dir
from llada_jax.training.tasks import held_out
from llada_jax.weights.checkpoint import save_hf
from lowering.bundle_cache import cached_bundle

BENCH_CONFIG = LLaDAConfig(d_model=1024, n_layers=4, n_heads=16, n_kv_heads=16, mlp_hidden_size=2816,
                           vocab_size=126464, embedding_size=126464, max_sequence_length=256)


def median_seconds(run, repeats: int) -> float:
    run()  # warm-up: compilation, first-touch
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_model_dir(cache: Path, config: LLaDAConfig = BENCH_CONFIG) -> Path:
    """A random-weights checkpoint of `config`, written once per shape."""
    out = cache / (f"bench-d{config.d_model}-l{config.n_layers}-h{config.mlp_hidden_size}"
                   f"-v{config.embedding_size}")
    return write_once(out, lambda out: (out / "config.json").is_file(),
                      lambda: save_hf(init_params(config, seed=0), config, out))


def step_rows(jax_b, iree_b, config, slots: int, widths: list[int], repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size - 1, (1, slots)).astype(np.int32)
    tokens[tokens == config.mask_token_id] = 0
    tokens[0, slots // 2:] = config.mask_token_id
    valid = np.ones((1, slots), bool)
    rows = [{"step": f"full S={slots}", "xla_ms": 1e3 * median_seconds(lambda: jax_b.full(tokens, valid), repeats),
             "iree_ms": 1e3 * median_seconds(lambda: iree_b.full(tokens, valid), repeats)}]
    states = [b.commit(b.empty_state(1, slots), np.arange(slots)[None], valid, b.full(tokens, valid), tokens, 0)
              for b in (jax_b, iree_b)]
    for width in widths:
        positions = np.arange(slots // 2, slots // 2 + width)[None]
        visible = valid & ~((np.arange(slots) >= slots // 2) & (np.arange(slots) < slots // 2 + width))[None]
        args = (visible, tokens[:, positions[0]], positions, np.ones((1, width), bool))
        rows.append({"step": f"window S={slots} W={width}",
                     "xla_ms": 1e3 * median_seconds(lambda: jax_b.window(states[0], *args), repeats),
                     "iree_ms": 1e3 * median_seconds(lambda: iree_b.window(states[1], *args), repeats)})
    return rows


def generation_rows(model, bundle, session, prompts: list[np.ndarray], repeats: int) -> list[dict]:
    rows = []
    for policy in ("vanilla", "dual-cache"):
        options = dict(gen_length=32, block_length=8, steps=32, policy=policy)

        def xla():
            for prompt in prompts:
                llada_jax.generate(model, prompt, **options)

        def iree():
            for prompt in prompts:
                generate_with_bundle(OpenBundle(bundle, session), prompt, **options)

        rows.append({"step": f"generate {policy} x{len(prompts)}", "xla_ms": 1e3 * median_seconds(xla, repeats),
                     "iree_ms": 1e3 * median_seconds(iree, repeats)})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded model)")
    parser.add_argument("--bench-size", action="store_true", help="random weights, d_model 1024, 126464 vocab")
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cache = user_cache_dir("bench-models")
    model_dir = bench_model_dir(cache) if args.bench_size else Path(args.model or default_model_dir())
    model = llada_jax.load(model_dir)
    bundle_dir = cached_bundle(model_dir, "host", max_len=args.slots, window=32)
    bundle = load_bundle(bundle_dir, "host")
    session = Session(bundle.path, bundle.manifest, "local-task")
    biases = TokenBiases.build(model.config.embedding_size)
    jax_b = JaxBackend(model.params, model.config, ReadoutSpec(), biases)
    iree_b = IreeBackend(bundle, session, ReadoutSpec(), biases)
    rows = step_rows(jax_b, iree_b, model.config, args.slots, [8, 32], args.repeats)
    if model.tokenizer is not None:
        prompts = [np.array(model.tokenizer.encode(model.tokenizer.chat_prompt(e.prompt))) for e in held_out(2)]
    else:  # random weights: random prompts that fit the compiled canvas
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, model.config.mask_token_id, args.slots - 32) for _ in range(2)]
    rows += generation_rows(model, bundle, session, prompts, max(3, args.repeats // 5))
    for row in rows:
        row["iree_over_xla"] = row["iree_ms"] / row["xla_ms"]
    if args.json:
        print(json.dumps({"model": str(model_dir), "rows": rows}))
        return
    print(f"model {model_dir} (d_model {model.config.d_model}, vocab {model.config.embedding_size})")
    print(f"{'step':<28}{'XLA ms':>10}{'IREE ms':>10}{'IREE/XLA':>10}")
    for row in rows:
        print(f"{row['step']:<28}{row['xla_ms']:>10.2f}{row['iree_ms']:>10.2f}{row['iree_over_xla']:>10.2f}")


if __name__ == "__main__":
    main()
