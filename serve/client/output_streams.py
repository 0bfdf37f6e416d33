"""A request's outputs on their way from the engine to the HTTP handler that reads them.

The engine reports, per step, what each moved request gained (an `OutputDelta`); the request's
`OutputStream` keeps the deltas its reader has not taken yet, and the reader merges them into the request's
one cumulative `RequestOutput` (vLLM's shape, `OutputBuilder`) when it reads. A request then
holds its output once plus what is unread, never a copy of its whole output per step.

What is unread is bounded (`max_backlog`, counted in token ids plus logprob entries): a reader that stops
taking outputs (a client that never reads its stream) has its unread deltas dropped, its request aborted
(`on_overflow`), which frees its slot, and an error where it would read next.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from draftsmith.errors import DraftsmithError
from draftsmith.serve.engine.outputs import OutputBuilder, OutputDelta, RequestOutput

DEFAULT_MAX_BACKLOG = 16384  # unread token ids + logprob entries per request (a few MB at most)


class RequestFailed(RuntimeError):
    """The engine failed this request alone (its `RequestOutput.error`): answered 500 with the reason."""


class BacklogFull(DraftsmithError):
    """The reader left more outputs unread than the backlog holds: the request was aborted."""


class OutputStream:
    """One request's unread deltas and, on the reader's side, its cumulative output.

    `push` and `fail` may be called from any thread; `outputs()` is iterated on the event loop that made the
    stream."""

    def __init__(self, request_id: str, n: int, prompt: str | None, prompt_token_ids: list[int],
                 max_backlog: int = DEFAULT_MAX_BACKLOG, on_overflow: Callable[[str], None] | None = None):
        self.request_id = request_id
        self.n = n  # cache slots it takes
        self.loop = asyncio.get_running_loop()
        self.max_backlog = max_backlog
        self.on_overflow = on_overflow
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self._pending: list[OutputDelta] = []
        self._backlog = 0
        self._error: BaseException | None = None
        self.closed = False  # finished, failed or cut off: nothing more is taken in
        self._output = OutputBuilder(request_id, prompt, prompt_token_ids, n)

    def push(self, delta: OutputDelta) -> None:
        overflow = False
        with self._lock:
            if self.closed:
                return
            if delta.error is not None:
                self._error, self.closed = RequestFailed(f"request failed: {delta.error}"), True
            else:
                self._pending.append(delta)
                self._backlog += delta.size
                self.closed = delta.finished
                if self._backlog > self.max_backlog and not delta.finished:
                    overflow = True
                    self._pending, self._backlog, self.closed = [], 0, True
                    self._error = BacklogFull(
                        f"the client left more than {self.max_backlog} tokens and logprobs of this stream unread; "
                        "the request was aborted")
        if overflow and self.on_overflow is not None:
            self.on_overflow(self.request_id)
        self._signal()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.closed:
                return
            self._error, self.closed = exc, True
        self._signal()

    def _signal(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the event loop has closed: nobody reads any more
            pass

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The cumulative output after each read (every delta pushed since the last one merged in), until the
        request finishes; its error, if it failed or was cut off."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                pending, self._pending, self._backlog = self._pending, [], 0
                error = self._error
            for delta in pending:
                output = self._output.add(delta)
            if pending:
                yield output
                if output.finished:
                    return
            if error is not None:
                raise error
