"""The embedded model: its synthetic tasks and its training."""
