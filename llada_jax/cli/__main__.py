"""`python -m llada_jax.cli`: the `llada` command."""

import sys

from llada_jax.cli import main

sys.exit(main())
