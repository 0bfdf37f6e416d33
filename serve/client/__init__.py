"""Engine clients: the prompt checks and tokenizer at the edge (`frontend`), the engine stepped on a
thread (`async_engine`) or in its own process (`engine_process`), and the output streams."""
