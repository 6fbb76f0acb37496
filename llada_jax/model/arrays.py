"""The type of an array field in the records both sides of a step share (readouts, KV state, loop inputs)."""

from typing import Any

# numpy on the host; a jax.Array (or an IREE buffer) on the device and while traced. The records stay free of
# JAX, so the bundle runtime imports them without it: the alias documents the field, it checks nothing.
Array = Any
