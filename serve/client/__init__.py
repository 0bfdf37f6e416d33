"""Engine clients (`engine_client`): the request checks and tokenizer at the edge (`frontend`), one engine
loop (`engine_loop`) on a thread (`thread_engine`) or in its own process (`engine_process`), the typed
messages between them (`frames`), and each request's output stream (`output_streams`)."""
