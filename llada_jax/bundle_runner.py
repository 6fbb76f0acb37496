"""Generation through a compiled bundle: `llada_jax.generate`'s options and validation, IREE steps, no JAX
(numpy + iree.runtime), as on a phone."""

from __future__ import annotations

import functools

from llada_jax.backends.select import OpenBundle, open_bundle, select_backend
from llada_jax.weights.tokenizer import load_tokenizer
from policies.generation import run_generation


def generate_with_bundle(opened: OpenBundle, prompt_ids, **options):
    """`llada_jax.generate` through an open bundle; canvases are limited by the bundle's compiled --max-len."""
    return run_generation(functools.partial(select_backend, opened), opened.config, prompt_ids,
                          limit=opened.bundle.manifest["max_len"], **options)


def bundle_runner(path, backend: str = "iree-host"):
    """(config, tokenizer, generate(ids, **options)) for the bundle at `path`."""
    opened = open_bundle(path, backend)
    return (opened.config, load_tokenizer(opened.bundle.path),
            functools.partial(generate_with_bundle, opened))
