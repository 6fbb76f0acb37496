"""Checkpoints on disk: the safetensors reader, HF layouts, loading, quantized checkpoints, the memory plan and
tokenizers."""
