"""What runs the engine for a user: the offline `LLM` API, `draftsmith generate`, `datagen`, `demo`."""
