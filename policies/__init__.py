"""Decoding policies: what each step computes and what it commits."""
