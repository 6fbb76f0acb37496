"""How far a quantized checkpoint's predictions move from the float32 computation of its source weights.

    python -m eval.scale_checkpoint --out /tmp/llada-real-vocab --layers 2   # LLaDA-8B's vocabulary and widths
    python -m eval.quant_agreement --model /tmp/llada-real-vocab
    python -m eval.quant_agreement                                            # the embedded (trained) model

Each scheme quantizes the checkpoint (as `llada quantize` does) into a temporary directory. Both models
run full-canvas forward passes in float32 over the same canvases (random ids, the second half masked, as
a generation's canvas is), and the masked positions' predictions are compared: how often the argmax
agrees, how often the reference's argmax is in the quantized model's top 5, the mean KL divergence
(reference || quantized) in nats, and the largest logit difference in units of the reference logits'
standard deviation. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

import llada_jax
from llada_jax.model.config import read_config
from llada_jax.quant.quantize import QuantScheme
from llada_jax.system.errors import LladaError
from llada_jax.system.locations import EMBEDDED_DIR
from llada_jax.weights.quant_config import EDGE_SCHEME
from llada_jax.weights.quantize_checkpoint import quantize_checkpoint

SCHEMES = {  # name -> (layer scheme, LM head scheme, activations)
    "int8": (QuantScheme(8), EDGE_SCHEME, "float"),
    "int8-w8a8": (QuantScheme(8), EDGE_SCHEME, "int8"),
    "int4-g32": (QuantScheme(4, 32), EDGE_SCHEME, "float"),
    "int4-g32-w4a8": (QuantScheme(4, 32), EDGE_SCHEME, "int8"),
    "int4-g128": (QuantScheme(4, 128), EDGE_SCHEME, "float"),
    "int4-g128-head4": (QuantScheme(4, 128), QuantScheme(4, 128), "float"),
}


def canvases(config, count: int, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(config.vocab_size, config.mask_token_id), (count, length)).astype(np.int32)
    ids[:, length // 2:] = config.mask_token_id
    return ids


def compare(reference: np.ndarray, quantized: np.ndarray) -> dict:
    """Agreement of `[N, E]` logits at the same positions."""
    top = reference.argmax(axis=-1)
    top5 = np.argsort(-quantized, axis=-1)[:, :5]
    ref_logp, q_logp = (np.asarray(jax.nn.log_softmax(logits, axis=-1)) for logits in (reference, quantized))
    kl = (np.exp(ref_logp) * (ref_logp - q_logp)).sum(axis=-1)
    return {"positions": len(top), "argmax_agreement": float((quantized.argmax(axis=-1) == top).mean()),
            "top5_agreement": float((top5 == top[:, None]).any(axis=-1).mean()), "mean_kl": float(kl.mean()),
            "max_abs_diff_in_std": float(np.abs(quantized - reference).max() / reference.std())}


def masked_logits(model_dir: Path, ids: np.ndarray, batch: int, activations: str = "float") -> np.ndarray:
    model = llada_jax.load(model_dir, dtype="float32", activations=activations)
    masked = ids == model.config.mask_token_id
    parts = [llada_jax.logits(model, ids[i:i + batch])[masked[i:i + batch]] for i in range(0, len(ids), batch)]
    return np.concatenate(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=EMBEDDED_DIR, help="a float checkpoint (default: embedded)")
    parser.add_argument("--scheme", action="append", choices=sorted(SCHEMES), help="repeat; default: all")
    parser.add_argument("--canvases", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="canvases per forward pass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.canvases, args.batch) < 1 or args.length < 2:
        parser.error("--canvases and --batch must be positive and --length at least 2 (half of it is masked)")
    try:
        report(args)
    except LladaError as error:
        parser.exit(1, f"quant_agreement: error: {error}\n")


def report(args) -> None:
    """One JSON line per scheme."""
    ids = canvases(read_config(args.model), args.canvases, args.length, args.seed)
    reference = masked_logits(args.model, ids, args.batch)
    for name in args.scheme or list(SCHEMES):
        scheme, head, activations = SCHEMES[name]
        with tempfile.TemporaryDirectory(prefix="quant-agreement-") as scratch:
            out = quantize_checkpoint(args.model, Path(scratch) / name, scheme, head=head)
            row = compare(reference, masked_logits(out, ids, args.batch, activations))
        print(json.dumps({"scheme": name, **row}), flush=True)


if __name__ == "__main__":
    main()
