"""OpenAI-compatible HTTP server (FastAPI) over the shared engine loop. `build_app` puts together one router
per endpoint (`monitoring`: /health, /version, /metrics; `models`; `tokenization`; `completions`; `chat`), the
error handlers (`http_errors`) and the limits at the HTTP edge (`http_limits`), all sharing one `ServerState`.

Handlers stay thin: validate the body with pydantic, turn it into token ids and `SamplingParams` (`prompts`),
and relay the engine's outputs (`outputs`, `streaming`). A route function's name is its operationId in
/openapi.json, and it carries no docstring, which FastAPI would publish as the operation's description.

No request can stall the others: bodies and keys are checked before a handler runs (`http_limits`), text
that cannot fit the context is refused untokenized (`Frontend.check_text`), and tokenizing, chat templates
and detokenizing whole sequences run on worker threads, off the event loop that streams everyone's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from draftsmith import __version__
from draftsmith.serve.client.engine_client import EngineClient
from draftsmith.serve.openai.chat import chat_router
from draftsmith.serve.openai.completions import completions_router
from draftsmith.serve.openai.http_errors import APIError, error_handlers, error_status
from draftsmith.serve.openai.http_limits import EdgeLimits
from draftsmith.serve.openai.metrics import ServerMetrics
from draftsmith.serve.openai.models import models_router
from draftsmith.serve.openai.monitoring import monitoring_router
from draftsmith.serve.openai.state import ServerOptions, ServerState
from draftsmith.serve.openai.tokenization import tokenize_router

__all__ = ["APIError", "ServerOptions", "ServerState", "build_app", "error_status"]


def build_app(engine: EngineClient, served_model_name: str, options: ServerOptions | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The server's app over `engine`, which starts with the app and stops after it, serving it as
    `served_model_name`; `app.state` holds the engine, the options and `begin_shutdown` (`cli`)."""
    state = ServerState(engine=engine, frontend=engine.frontend, metrics=metrics or ServerMetrics(served_model_name),
                        options=options or ServerOptions(), model_name=served_model_name)
    app = FastAPI(title="draftsmith", version=__version__, lifespan=_lifespan(state),
                  exception_handlers=error_handlers(state))
    app.state.engine, app.state.options = engine, state.options
    # SIGTERM (`cli`): requests still running after --shutdown-timeout end with an error while their
    # connections are open
    app.state.begin_shutdown = lambda: engine.begin_shutdown(state.options.shutdown_timeout)
    app.openapi = functools.partial(_openapi_schema, app)

    public = frozenset({"/health", "/metrics"} if state.options.public_metrics else {"/health"})
    app.add_middleware(EdgeLimits, api_key=state.options.api_key, max_body_bytes=state.options.max_body_bytes,
                       public_paths=public, on_refused=state.count_failure)
    # The order of the routes is the order of /openapi.json's paths.
    for router in (monitoring_router(state), models_router(state), tokenize_router(state),
                   completions_router(state), chat_router(state)):
        app.include_router(router)
    return app


def _lifespan(state: ServerState) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine starts with the app; at the end, requests still in flight get
    --shutdown-timeout to finish, then are cancelled."""
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        # uvicorn has stopped taking connections and waited for open ones; finish or cancel the rest.
        await asyncio.to_thread(state.engine.shutdown, state.options.shutdown_timeout)

    return lifespan


def _openapi_schema(app: FastAPI) -> dict:
    """The app's /openapi.json, made once: FastAPI's, less the 422 answers, since a body that fails
    validation answers 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema
