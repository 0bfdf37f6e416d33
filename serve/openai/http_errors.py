"""How the server answers a failure: `APIError` (what a route raises to answer with a status), the status of an
engine's error, the exception handlers that turn every failure into OpenAI's error body, and the error statuses
/openapi.json documents for each route.

A body that fails validation answers 400, as in OpenAI's API, never FastAPI's 422.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftsmith.errors import DraftsmithError, format_validation_error
from draftsmith.serve.client.engine_client import RequestRejected
from draftsmith.serve.client.output_streams import BacklogFull
from draftsmith.serve.openai.protocol import ErrorResponse, error_body
from draftsmith.serve.openai.state import ServerState


def error_status(exc: BaseException) -> int:
    """The HTTP status of a request's failure: refused by the engine or cut off for not reading 400, the server
    unavailable 503, else 500."""
    if isinstance(exc, (RequestRejected, BacklogFull)):
        return 400
    return 503 if isinstance(exc, DraftsmithError) else 500


class APIError(Exception):
    """A request's failure, answered with `status` in OpenAI's error body; `param` names the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body as a response with `status`."""
    return JSONResponse(error_body(message, status, param), status_code=status)


# What each error status means, as /openapi.json describes it
_STATUS_MEANINGS = {
    400: "invalid request (the message names the field)",
    401: "missing or wrong API key (--api-key)",
    404: "no such model",
    413: "request body over --max-body-bytes",
    499: "the client disconnected before the answer",
    500: "the engine failed while running the request (the message says why)",
    503: "queue full (--max-queue), engine restarting or stopped, or the server shutting down",
}


def documented_errors(*statuses: int) -> dict:
    """What /openapi.json says a route may answer besides 200: each of `statuses`, in OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": _STATUS_MEANINGS[status]} for status in statuses}


# The answers of /v1/completions and /v1/chat/completions
GENERATION_RESPONSES = {
    200: {"description": "the answer; with stream=true, server-sent events ending in `data: [DONE]`",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **documented_errors(400, 401, 404, 413, 499, 500, 503)}


def error_handlers(state: ServerState) -> dict[type[Exception], Callable]:
    """The app's exception handlers: an invalid body, an `APIError` and Starlette's own errors (no such route,
    method not allowed) all answer in OpenAI's error body; the first two are counted as failed requests."""

    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        message = format_validation_error(exc, skip_loc=("body",), whole="")
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        state.count_failure(400)
        return error_response(400, message, param)

    async def on_api_error(_request: Request, exc: APIError) -> JSONResponse:
        state.count_failure(exc.status)
        return error_response(exc.status, exc.message, exc.param)

    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    return {RequestValidationError: on_validation_error, APIError: on_api_error,
            StarletteHTTPException: on_http_error}
