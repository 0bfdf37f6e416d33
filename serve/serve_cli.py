"""`draftsmith serve`: load the model, start the engine loop, serve the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time

import uvicorn

from draftsmith.errors import DraftsmithError
from draftsmith.serve.api_server import build_app
from draftsmith.serve.async_engine import AsyncEngine
from draftsmith.serve.engine_process import start_engine_process
from draftsmith.serve.llm import LLM, engine_kwargs
from draftsmith.serve.server_metrics import ServerMetrics


def build_server_app(llm: LLM, served_model_name: str, api_key: str | None = None, max_queue: int = 256,
                     shutdown_timeout: float = 30.0):
    spec = llm.engine.spec_config
    metrics = ServerMetrics(served_model_name, spec.num_speculative_tokens if spec else 0)
    engine = AsyncEngine(llm, max_queue=max_queue, observer=metrics.observe_engine)
    return build_app(engine, served_model_name, api_key, metrics, shutdown_timeout)


def build_process_server_app(llm_kwargs: dict, served_model_name: str, api_key: str | None = None,
                             max_queue: int = 256, shutdown_timeout: float = 30.0):
    """The app over an engine process running `LLM(**llm_kwargs)` (started here; the model loads there)."""
    engine = start_engine_process(llm_kwargs, max_queue)
    metrics = ServerMetrics(served_model_name, engine.num_speculative_tokens)
    engine.observer = metrics.observe
    return build_app(engine, served_model_name, api_key, metrics, shutdown_timeout)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise DraftsmithError(f"--port {args.port} is not a TCP port")
    with socket.socket() as probe:  # fail before loading the model if the port is taken
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise DraftsmithError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    llm_kwargs = {"model": args.model, **engine_kwargs(args)}
    name = args.served_model_name or args.model
    if args.engine_process:
        app = build_process_server_app(llm_kwargs, name, args.api_key, args.max_queue, args.shutdown_timeout)
    else:
        app = build_server_app(LLM(**llm_kwargs), name, args.api_key, args.max_queue, args.shutdown_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=int(args.shutdown_timeout))
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_in_thread(app, host: str = "127.0.0.1", port: int | None = None):
    """Runs `app` under a real uvicorn server on loopback in a thread; yields the base URL (tests, bench)."""
    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
