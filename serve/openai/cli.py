"""`draftsmith serve`: load the model, start the engine loop, serve the OpenAI API with uvicorn.

The server exits with status 1 when its engine process has died more often than --max-engine-restarts allows
(`engine_process`), for a supervisor (systemd, Kubernetes) to restart it; SIGTERM gives requests in flight
--shutdown-timeout seconds, then ends them with an error (a stream's error event and [DONE]) before the
connections close.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from draftsmith.errors import DraftsmithError
from draftsmith.serve.apps.llm import LLM, engine_kwargs
from draftsmith.serve.check.cli import gate_served_head
from draftsmith.serve.client.engine_process import start_engine_process
from draftsmith.serve.client.thread_engine import ThreadEngine
from draftsmith.serve.openai.acceptance_drift import served_record
from draftsmith.serve.openai.app import ServerOptions, build_app
from draftsmith.serve.openai.metrics import ServerMetrics
from draftsmith.serve.speculation.config import parse_speculative_config

logger = logging.getLogger("draftsmith")

SHUTDOWN_GRACE_S = 5.0  # uvicorn's wait past --shutdown-timeout, for the requests' error events to go out


def build_server_app(llm: LLM, served_model_name: str, options: ServerOptions | None = None, **overrides):
    """The app over an engine on a thread of this process; `overrides`: ServerOptions fields."""
    options = dataclasses.replace(options or ServerOptions(), **overrides)
    spec = llm.engine.spec_config
    metrics = ServerMetrics(served_model_name, spec.num_speculative_tokens if spec else 0, served_record(spec))
    engine = ThreadEngine(llm, options.max_queue, metrics.observe, options.max_stream_backlog)
    return build_app(engine, served_model_name, options, metrics)


def build_process_server_app(llm_kwargs: dict, served_model_name: str, options: ServerOptions | None = None,
                             gate: bool = False, **overrides):
    """The app over an engine process running `LLM(**llm_kwargs)` (started here; the model loads there, and
    with `gate` the acceptance gate runs there on it)."""
    options = dataclasses.replace(options or ServerOptions(), **overrides)
    engine = start_engine_process(llm_kwargs, options.max_queue, max_backlog=options.max_stream_backlog,
                                  max_restarts=options.max_engine_restarts, gate=gate)
    record = served_record(parse_speculative_config(llm_kwargs.get("speculative_config")))
    metrics = ServerMetrics(served_model_name, engine.num_speculative_tokens, record)
    engine.observer = metrics.observe
    engine.on_restart = metrics.engine_restarted
    return build_app(engine, served_model_name, options, metrics)


class DraftsmithServer(uvicorn.Server):
    """uvicorn's server, which starts the app's shutdown deadline (`begin_shutdown`) when it starts stopping."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app

    async def shutdown(self, sockets=None) -> None:
        begin = getattr(self.app.state, "begin_shutdown", None)
        if begin is not None:
            begin()
        await super().shutdown(sockets)


def make_server(app, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> DraftsmithServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(shutdown_timeout + SHUTDOWN_GRACE_S))
    return DraftsmithServer(config, app)


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(api_key=args.api_key, public_metrics=args.public_metrics, max_queue=args.max_queue,
                         shutdown_timeout=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
                         max_stream_backlog=args.max_stream_backlog, max_engine_restarts=args.max_engine_restarts)


def _gate(args: argparse.Namespace, target) -> None:
    """`draftsmith check`'s gate on the served head, before the server listens (`--no-check` skips it)."""
    passed = gate_served_head(parse_speculative_config(args.speculative_config), Path(args.model), target)
    if passed:
        logger.info(passed)


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
    options = server_options(args)
    gated = not args.no_check and parse_speculative_config(args.speculative_config) is not None
    if args.engine_process:  # the gate runs in the engine process, on the one target it loads
        app = build_process_server_app(llm_kwargs, name, options, gate=gated)
    else:
        llm = LLM(**llm_kwargs)
        if gated:
            _gate(args, llm.model)
        app = build_server_app(llm, name, options)
    server = make_server(app, args.host, args.port, options.shutdown_timeout)
    fatal: list[str] = []

    def give_up(reason: str) -> None:  # on the supervisor thread: uvicorn polls should_exit
        fatal.append(reason)
        server.should_exit = True

    app.state.engine.on_fatal = give_up
    server.run()
    if fatal:
        print(f"draftsmith serve: error: {fatal[0]}; exiting for a supervisor to restart the server", file=sys.stderr)
        return 1
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_in_thread(app, host: str = "127.0.0.1", port: int | None = None):
    """Runs `app` under a real uvicorn server on loopback in a thread; yields the base URL (tests, bench)."""
    port = port or free_port(host)
    server = make_server(app, host, port, app.state.options.shutdown_timeout, log_level="warning")
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
