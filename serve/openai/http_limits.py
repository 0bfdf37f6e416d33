"""What the HTTP edge refuses before a handler runs: requests without the API key, and bodies over the size
limit. Both answer in OpenAI's error shape.

`--api-key` covers every route but `/health` (and `/metrics` with `--public-metrics`, for scrapers that
cannot send a key). The body limit is checked against Content-Length before anything is read, and counted
while a chunked body is read here first (up to the limit), so an oversized body never reaches the JSON
parser or the tokenizer.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from draftsmith.serve.openai.protocol import error_body

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


async def _answer(send, status: int, message: str) -> None:
    body = json.dumps(error_body(message, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class EdgeLimits:
    """Pure ASGI middleware: the API key, then the body size (`on_refused(status)` counts each refusal)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, public_paths: frozenset[str],
                 on_refused: Callable[[int], None] | None = None):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.public_paths = public_paths
        self.on_refused = on_refused or (lambda status: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in self.public_paths:
            if not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.api_key}".encode()):
                self.on_refused(401)
                return await _answer(send, 401, "invalid or missing API key (send 'Authorization: Bearer KEY')")
        declared = headers.get(b"content-length")
        if declared is None:
            return await self._counted(scope, receive, send)
        if not declared.isdigit():
            self.on_refused(400)
            return await _answer(send, 400, "Content-Length is not a number")
        if int(declared) > self.max_body_bytes:
            self.on_refused(413)
            return await _answer(send, 413, self._too_large())
        await self.app(scope, receive, send)  # the server reads no more than the declared length

    def _too_large(self) -> str:
        return f"request body is larger than this server's limit of {self.max_body_bytes} bytes (--max-body-bytes)"

    async def _counted(self, scope, receive, send) -> None:
        """Runs the app on a body that declares no length (chunked), read here first up to the limit."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it as it would have
                return await self.app(scope, _replay([message], receive), send)
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                self.on_refused(413)
                return await _answer(send, 413, self._too_large())
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(parts), "more_body": False}
        await self.app(scope, _replay([body], receive), send)


def _replay(messages: list[dict], receive):
    """A receive that hands out `messages` first, then the connection's own (a disconnect, later)."""
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed
