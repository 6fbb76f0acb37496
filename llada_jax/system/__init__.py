"""The platform under everything: errors, atomic writes, the host's CPU and memory, locations, XLA's compile cache."""
