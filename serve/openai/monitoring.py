"""The routes a supervisor or a scraper polls: GET /health, GET /version and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from draftsmith import __version__
from draftsmith.serve.openai.http_errors import documented_errors, error_response
from draftsmith.serve.openai.state import ServerState

_HEALTHY = {200: {"description": "the engine is stepping",
                  "content": {"application/json": {"example": {"status": "ok"}}}}}
_PROMETHEUS_TEXT = {200: {"description": "Prometheus text exposition format",
                          "content": {"text/plain": {"schema": {"type": "string"}}}}}


def monitoring_router(state: ServerState) -> APIRouter:
    """/health: 200 while the engine steps, else 503 saying why; /version; /metrics: the server's metrics."""
    router = APIRouter()

    @router.get("/health", responses={**_HEALTHY, **documented_errors(503)})
    async def health():
        if not state.engine.healthy:
            return error_response(503, f"the engine is not running: {state.engine.unavailable_reason()}")
        return {"status": "ok"}

    @router.get("/version", responses=documented_errors(401))
    async def version():
        return {"version": __version__}

    @router.get("/metrics", response_class=PlainTextResponse, responses={**_PROMETHEUS_TEXT, **documented_errors(401)})
    async def prometheus_metrics():
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
