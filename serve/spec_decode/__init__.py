"""Speculative decoding inside the engine: the `--speculative-config` schema, verification (rejection
sampling, PyTorch and Triton) and its metrics. Methods themselves (proposers) live in `draftsmith.methods`."""
