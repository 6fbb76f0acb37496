# pyright: reportMissingImports=false
# (it runs under the reference's Python, which has torch; this environment has none)
"""Runs the public PyTorch reference on a job read from stdin (JSON). A decoding job prints one JSON line per
answer: the decoder, the seconds of its generate call, its NFE and the answer's ids. A forward job
(`"kind": "forward"`) prints one line: the model's load time, its first forward's time and the median time of
a full forward (logits at every position) per canvas width, and this process's peak RSS.

The reference is Fast-dLLM's `llada/generate.py` (`generate`, LLaDA's decoder without a cache, and
`generate_with_prefix_cache` / `generate_with_dual_cache`) in a checkout the user names: nothing of it is
part of llada-jax. `llada bench --reference` starts this file by path with an interpreter that has torch
(`--reference-python`), so it imports nothing of llada-jax and nothing but the standard library and torch.
"""

import importlib
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

FUNCTIONS = {"vanilla": "generate", "prefix-cache": "generate_with_prefix_cache",
             "dual-cache": "generate_with_dual_cache"}


def reference_module(root: str):
    """Fast-dLLM's `llada.generate`; its older copies import `model.modeling_llada` from inside `llada/`."""
    sys.path[:0] = [root, str(Path(root) / "llada")]
    return importlib.import_module("llada.generate")


def decode(module, model, decoder: dict, ids: list[int], job: dict, gen_length: int, steps: int):
    """(seconds, nfe or None, answer ids) of one reference generate call at temperature 0."""
    prompt = torch.tensor([ids])
    started = time.perf_counter()
    out = getattr(module, FUNCTIONS[decoder["policy"]])(
        model, prompt, steps=steps, gen_length=gen_length, block_length=job["block_length"], temperature=0.0,
        remasking="low_confidence", mask_id=job["mask_id"], threshold=decoder["threshold"])
    seconds = time.perf_counter() - started
    canvas, nfe = out if isinstance(out, tuple) else (out, None)  # LLaDA's own generate returns the canvas only
    return seconds, nfe, canvas[0, len(ids):].tolist()


def timed_forward(model, ids) -> float:
    started = time.perf_counter()
    model(ids)
    return time.perf_counter() - started


def forward_row(module, job: dict) -> dict:
    """Load, first forward (it pages the mapped weights in) and the median of `repeats` forwards per width."""
    started = time.perf_counter()
    model = module.LLaDAModelLM.from_pretrained(job["model"], torch_dtype=getattr(torch, job["dtype"])).eval()
    row = {"load_s": time.perf_counter() - started}
    draw = random.Random(0)
    with torch.no_grad():
        for width in job["widths"]:
            ids = torch.tensor([[draw.randrange(job["vocab"]) for _ in range(width)]])
            first = timed_forward(model, ids)
            row.setdefault("first_s", first)
            row[f"forward_s_{width}"] = statistics.median(timed_forward(model, ids) for _ in range(job["repeats"]))
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return row


def main() -> None:
    job = json.load(sys.stdin)
    torch.set_num_threads(job["threads"])
    module = reference_module(job["reference"])
    if job.get("kind") == "forward":
        print(json.dumps(forward_row(module, job)), flush=True)
        return
    model = module.LLaDAModelLM.from_pretrained(job["model"], torch_dtype=torch.float32).eval()
    one_block = job["steps"] * job["block_length"] // job["gen_length"]
    for decoder in job["decoders"]:
        # warm-up: one block of the first prompt (the first calls of a decoder allocate)
        decode(module, model, decoder, job["prompts"][0], job, job["block_length"], one_block)
        for index, ids in enumerate(job["prompts"]):
            seconds, nfe, answer = decode(module, model, decoder, ids, job, job["gen_length"], job["steps"])
            print(json.dumps({**decoder, "prompt": index, "seconds": seconds, "nfe": nfe, "answer": answer}),
                  flush=True)


if __name__ == "__main__":
    main()
