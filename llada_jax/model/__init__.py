"""The model: config, params and their layouts, the pure forward, KV state, fixed-shape steps and their read-outs."""
