"""Swap-optimized execution: weights streamed through a device budget in packed stages."""
