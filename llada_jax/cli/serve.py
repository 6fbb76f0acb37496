"""`llada serve`: the OpenAI-compatible server (see `llada_jax.server.app`) on uvicorn."""

from __future__ import annotations

import functools
import math
import os
import socket
import sys

from llada_jax.backends.select import OpenBundle, check_request, select_backend
from llada_jax.cli.flags import add_decoding_flags, add_model_flags, decoding_kwargs, model_dir, path_arg
from llada_jax.cli.runner import add_runner_flags, opened_source
from llada_jax.model.shapes import bucket
from llada_jax.server.engine import Engine
from llada_jax.server.requests import Defaults, Served
from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import load_tokenizer
from policies.options import BLOCK_OPTIONS
from policies.registry import DecoderSetting
from policies.schedule import Schedule


def serving_defaults(args, config) -> Defaults:
    """The decoder flags as the server's defaults for the model of `config`, checked now rather than at the
    first request."""
    decoding = decoding_kwargs(args, config)
    if not config.block_causal:
        Schedule(args.gen_length, args.block_length, decoding["steps"])
    DecoderSetting(decoding["policy"], decoding["threshold"])
    if not all(0 <= value < math.inf for value in (args.temperature, args.cfg_scale)):
        raise LladaError("--temperature and --cfg-scale must be finite numbers >= 0")
    block_options = tuple((name, decoding[name]) for name in BLOCK_OPTIONS if name in decoding)
    return Defaults(args.gen_length, args.block_length, decoding["steps"], args.temperature, args.cfg_scale,
                    args.remasking, decoding["policy"], decoding["threshold"], args.seed, args.forbid_eos,
                    args.no_eos_confidence, block_options)


def check_serve_flags(args) -> None:
    if not 0 < args.port < 65536:
        raise LladaError(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch < 1 or args.max_queue < 0:
        raise LladaError(f"--max-batch must be >= 1 and --max-queue >= 0, got {args.max_batch} and {args.max_queue}")
    if args.loop == "compiled":
        raise LladaError("llada serve batches generations on the host loop; drop --loop compiled")


def served_model(args) -> tuple[Served, Engine]:
    """The model (JAX, or an IREE bundle compiled for batches up to --max-batch) and its engine."""
    sizes = tuple(sorted({1 << k for k in range(args.max_batch.bit_length())} | {args.max_batch}))
    source = opened_source(args, batch_sizes=sizes)
    defaults = serving_defaults(args, source.config)
    if isinstance(source, OpenBundle):
        tokenizer, limit, name = load_tokenizer(source.bundle.path), source.bundle.manifest["max_len"], args.bundle
    else:
        tokenizer, limit, name = source.tokenizer, None, str(model_dir(args))
    if tokenizer is None:
        raise LladaError(f"{name} has no tokenizer.json: the server needs one to read prompts and write answers")
    served = Served(args.served_model_name or _short_name(name), source.config, tokenizer, defaults, limit,
                    functools.partial(check_request, source))
    engine = Engine(functools.partial(select_backend, source), bucket(served.context), args.max_batch,
                    args.max_queue)
    return served, engine


def _short_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] or path


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a taken port is a one-line error at once (uvicorn
    would log it and exit with status 0)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise LladaError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def api_key(args) -> str | None:
    """--api-key, else LLADA_API_KEY, else none (an open server)."""
    key = args.api_key if args.api_key is not None else os.environ.get("LLADA_API_KEY")
    if key is not None and not key.strip():
        raise LladaError("the API key (--api-key or LLADA_API_KEY) must not be empty")
    return key


def cmd_serve(args) -> None:
    if args.model_path is not None:
        if args.model is not None:
            raise LladaError("give the model either positionally or with --model, not both")
        args.model = args.model_path
    check_serve_flags(args)
    key = api_key(args)
    sock = listening_socket(args.host, args.port)
    served, engine = served_model(args)
    import uvicorn  # the server itself, only for this command

    from llada_jax.server.app import create_app

    print(f"llada: serving {served.name} on http://{args.host}:{args.port}/v1 ({args.max_batch} generations at "
          f"once, {args.max_queue} waiting; context {served.context} tokens{'; API key required' if key else ''})",
          file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(create_app(served, engine, key), log_level=args.log_level))
    server.run(sockets=[sock])


def add_serve(commands) -> None:
    """`llada serve`."""
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming)")
    serve.add_argument("model_path", nargs="?", metavar="MODEL", type=path_arg,
                       help="HF LLaDA directory (the same as --model)")
    add_model_flags(serve)
    add_runner_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: the "
                       "model directory's name)")
    serve.add_argument("--max-batch", type=int, default=8, help="generations decoded together (rows of one batch)")
    serve.add_argument("--max-queue", type=int, default=32, help="requests waiting for a row; beyond: 429")
    serve.add_argument("--api-key", default=None, help="require this bearer token on /v1 requests (default: "
                       "LLADA_API_KEY if set, else none)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_decoding_flags(serve)
    serve.set_defaults(run=cmd_serve, seed=None)  # without --seed, a request without one samples afresh
