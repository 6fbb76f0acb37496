"""Our own quantized matmul micro-kernels (C, in `c/`): built on this machine with its C compiler, called from
XLA's CPU path (`xla`), and linked into IREE bundles' dispatches."""
