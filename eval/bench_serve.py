"""Server latency and throughput: `python -m eval.bench_serve [--streams 1,8] [--requests 32] [-- SERVE FLAGS]`.

Starts `llada serve` (the embedded model unless serve flags say otherwise) on a free local port, then, per
concurrency level, sends the held-out tasks as streamed chat requests from that many clients at once (after
an untimed pass that compiles the level's batch shapes) and reports medians of the time to the first
streamed text and of the whole answer, answers/s and the answers' exactness. The client side is plain
HTTP (http.client): what is measured is the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

from llada_jax.training.tasks import FAMILIES, exact_match, held_out

MODEL_NAME = "bench"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, serve_flags: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "llada_jax.cli", "serve", "--port", str(port), "--served-model-name", MODEL_NAME,
               "--log-level", "warning", *serve_flags]
    server = subprocess.Popen(command)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"llada serve exited with status {server.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("llada serve did not answer /health within 300 s")


def streamed_chat(port: int, question: str) -> dict:
    """One streamed chat request: its text, seconds to the first text and to the end."""
    body = json.dumps({"model": MODEL_NAME, "stream": True, "messages": [{"role": "user", "content": question}]})
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"the server answered {response.status}: {response.read()[:300]!r}")
    text, first = "", None
    for line in response:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: "):])
        if "error" in chunk:
            raise SystemExit(f"generation failed: {chunk['error']['message']}")
        piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
        if piece:
            first = first if first is not None else time.perf_counter() - started
            text += piece
    total = time.perf_counter() - started
    return {"text": text, "first_s": first if first is not None else total, "total_s": total}


def run_level(port: int, examples, streams: int) -> dict:
    """Every example once, `streams` clients at a time."""
    results: list[dict] = [{} for _ in examples]  # each request's, once its client has run it
    next_index = iter(range(len(examples)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            results[index] = streamed_chat(port, examples[index].prompt)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {"streams": streams, "requests": len(examples), "answers_per_s": len(examples) / wall,
            "first_text_s": statistics.median(r["first_s"] for r in results),
            "latency_s": statistics.median(r["total_s"] for r in results),
            "exact": sum(exact_match(r["text"], e.answer) for r, e in zip(results, examples)) / len(examples)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_serve", description=str(__doc__).splitlines()[0])
    parser.add_argument("--streams", default="1,8", help="concurrent clients per level, e.g. 1,8")
    parser.add_argument("--requests", type=int, default=32, help="held-out tasks sent per level")
    parser.add_argument("--json", action="store_true")
    args, serve_flags = parser.parse_known_args(argv)
    serve_flags = [flag for flag in serve_flags if flag != "--"]
    levels = [int(part) for part in args.streams.split(",")]
    if args.requests < 1 or any(level < 1 for level in levels):
        raise SystemExit("--requests and every --streams level must be positive")
    every = held_out(-(-args.requests // len(FAMILIES)))  # ordered by family: take every k-th
    examples = every[:: len(every) // args.requests][: args.requests]
    port = free_port()
    server = start_server(port, serve_flags)
    try:
        rows = []
        for streams in levels:  # each level runs once untimed first: its batch shapes compile outside the timing
            run_level(port, examples, streams)
            rows.append(run_level(port, examples, streams))
    finally:
        server.terminate()
        server.wait(30)
    if args.json:
        print(json.dumps(rows))
        return
    print("| streams | requests | answers/s | median first text s | median latency s | exact |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['streams']} | {row['requests']} | {row['answers_per_s']:.2f} | {row['first_text_s']:.3f} | "
              f"{row['latency_s']:.3f} | {row['exact']:.3f} |")


if __name__ == "__main__":
    main()
