"""Quantized weights: the schemes and the quantized matmul."""
