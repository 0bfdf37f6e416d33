"""Speculation inside the engine: the `--speculative-config` schema, verification (chains and trees,
rejection sampling in PyTorch and Triton), and the policy that sizes each step with its cost model."""
