"""Backends: the XLA implementations of `llada_jax.backends.xla.Backend` (resident and staged) and the one place
that chooses what runs a generation (`select`). The IREE implementations live in `lowering`."""
