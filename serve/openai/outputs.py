"""From the engine's outputs to a whole answer: a request run to its end (`collect`), the latency and finish
metrics of a finished one, and the token text a response's logprobs show."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import Request

from draftsmith.errors import DraftsmithError
from draftsmith.serve.client.engine_client import RequestOutputs
from draftsmith.serve.client.frontend import Frontend
from draftsmith.serve.engine.outputs import RequestOutput
from draftsmith.serve.openai.http_errors import APIError, error_status
from draftsmith.serve.openai.state import ServerState

DISCONNECT_POLL_S = 0.5  # how often a request that is not streamed checks that its client is still there


def token_text(frontend: Frontend, token: int) -> str:
    """One token id's text, as a response's logprobs show it."""
    return frontend.tokenizer.decode([token])


def record_finished(state: ServerState, output: RequestOutput, start: float) -> None:
    """Observes a finished request's end-to-end latency and counts it by its first sample's finish reason."""
    state.metrics.e2e.labels(state.model_name).observe(time.perf_counter() - start)
    state.metrics.request_success.labels(state.model_name, output.outputs[0].finish_reason or "stop").inc()


async def collect(state: ServerState, raw: Request, outputs: RequestOutputs, start: float) -> RequestOutput:
    """Runs a request that is not streamed to its end and returns its last output; a client that disconnects
    cancels it (499), an engine failure is answered with `error_status`."""
    async def consume() -> RequestOutput | None:
        last, first_at = None, None
        async for last in outputs:  # noqa: B007
            if first_at is None and any(c.token_ids for c in last.outputs):
                first_at = time.perf_counter()
                state.metrics.ttft.labels(state.model_name).observe(first_at - start)
        return last

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not done and await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await outputs.aclose()
                raise APIError(499, "client disconnected")
    except asyncio.CancelledError:  # cancelled from outside: cancelling the consumer aborts the request
        task.cancel()
        raise
    try:
        return task.result()
    except (DraftsmithError, RuntimeError) as exc:
        raise APIError(error_status(exc), str(exc)) from None
