"""What the server holds to run requests: an engine client (vLLM's `EngineClient`). Two implement it: the
engine on a thread of this process (`thread_engine`), or in a supervised engine process (`engine_process`);
both drive the same `EngineLoop` with the same commands and reports (`frames`).

What they share is here: submitting a checked request, the queue bound, each request's output stream
(`output_streams`), failing and aborting what is in flight, and the shutdown deadline. A request the
engine cannot take, or one it fails alone, fails alone.
"""

from __future__ import annotations

import abc
import logging
import threading
import time

from draftsmith.errors import DraftsmithError
from draftsmith.serve.client.frames import AbortRequest, AddFailed, AddRequest, StepReport
from draftsmith.serve.client.frontend import Frontend
from draftsmith.serve.client.output_streams import DEFAULT_MAX_BACKLOG, OutputStream
from draftsmith.serve.engine.checks import CheckedRequest
from draftsmith.serve.engine.outputs import RequestOutput

logger = logging.getLogger("draftsmith")


class QueueFullError(DraftsmithError):
    """More requests are waiting than --max-queue allows, or the engine is not taking requests (503)."""


class RequestRejected(DraftsmithError):
    """The engine refused the request when it was added (400)."""


class RequestOutputs:
    """What `submit` returns: an async iterator over a request's cumulative outputs. Leaving it before the
    request finished (closing it, an exception or cancellation while reading, or dropping it unread) aborts
    the request, which frees its slot."""

    def __init__(self, client: EngineClient, request_id: str, stream: OutputStream):
        self.client, self.request_id, self.stream = client, request_id, stream
        self._outputs = stream.outputs()
        self._left = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self._outputs.__anext__()
        except BaseException:  # the end, a failure, or the reader cancelled
            self.abort()
            raise

    async def aclose(self) -> None:
        self.abort()
        await self._outputs.aclose()

    def abort(self) -> None:
        """Aborts the request unless the engine already finished or failed it (idempotent)."""
        if not self._left:
            self._left = True
            if not self.stream.closed:
                self.client.abort(self.request_id)

    def __del__(self):
        try:
            self.abort()
        except Exception:  # a client torn down already (interpreter exit): nothing left to abort
            pass


class EngineClient(abc.ABC):
    """Submits checked requests to an engine loop and hands each its outputs as they come."""

    frontend: Frontend | None  # the tokenizer, template and request checks (set once the model is known)

    def __init__(self, max_queue: int, max_backlog: int = DEFAULT_MAX_BACKLOG):
        self.max_queue = max_queue
        self.max_backlog = max_backlog
        self._streams: dict[str, OutputStream] = {}  # in flight, in the order they came (the engine's)
        self._lock = threading.Lock()
        self._ids = 0
        self._shutdown_timer: threading.Timer | None = None

    # ------------------------------------------------------------------------- what each client does
    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Finishes in-flight work for up to `timeout` seconds, then cancels the rest."""

    @property
    @abc.abstractmethod
    def healthy(self) -> bool:
        """Taking requests."""

    @abc.abstractmethod
    def unavailable_reason(self) -> str: ...

    @abc.abstractmethod
    def _send(self, command: AddRequest | AbortRequest) -> None:
        """Hands a command to the engine loop (never blocking the caller)."""

    # -------------------------------------------------------------------------------------- requests
    def submit(self, request: CheckedRequest) -> RequestOutputs:
        """Queues a checked request (raising QueueFullError at once if the queue is full or the engine is not
        serving) and returns an async iterator over its outputs; leaving it early aborts the request."""
        with self._lock:  # checked under the lock: a supervisor failing every stream sees this one or refuses it
            if not self.healthy:
                raise QueueFullError(self.unavailable_reason())
            if self._waiting_for_slots(request.params.n) > self.max_queue:
                raise QueueFullError(f"server queue is full ({self.max_queue} waiting requests); retry later")
            self._ids += 1
            request_id = f"req-{self._ids}"
            stream = OutputStream(request_id, request.params.n, request.prompt, request.prompt_token_ids,
                                  self.max_backlog, self.abort_unread)
            self._streams[request_id] = stream
        self._send(AddRequest(request_id, request.prompt_token_ids, request.params, request.prompt))
        return RequestOutputs(self, request_id, stream)

    def abort(self, request_id: str) -> None:
        """Forgets a request's stream and aborts it in the engine, which frees its slot."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(AbortRequest(request_id))

    def abort_unread(self, request_id: str) -> None:
        """A stream's reader left too much unread (`OutputStream`): abort its request."""
        logger.warning("request %s: its client is not reading its stream; aborting it", request_id)
        self.abort(request_id)

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def _waiting_for_slots(self, n: int) -> int:
        """How many in-flight requests, with one more of `n` samples, would wait for cache slots (under the
        lock; --max-queue bounds it): the engine admits first come first served while a request's samples
        fit the free slots, so every request from the first that does not fit waits."""
        free, waiting = self.frontend.max_num_seqs, 0
        for takes in [s.n for s in self._streams.values()] + [n]:
            if waiting or takes > free:
                waiting += 1
            else:
                free -= takes
        return waiting

    # -------------------------------------------------------------------------------- from the loop
    def take_report(self, report: StepReport | AddFailed) -> None:
        """Hands a step's deltas to their streams, or fails the request the engine would not take."""
        if isinstance(report, AddFailed):
            failure = RequestRejected if report.refused else RuntimeError
            self.fail(report.request_id, failure(report.message))
            return
        for delta in report.deltas:
            with self._lock:  # dropped if the request was aborted meanwhile
                stream = self._streams.get(delta.request_id)
                if stream is not None and (delta.finished or delta.error is not None):
                    del self._streams[delta.request_id]
            if stream is not None:
                stream.push(delta)

    def fail(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(exc)

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.fail(request_id, exc)

    # ------------------------------------------------------------------------------------- shutdown
    def begin_shutdown(self, timeout: float) -> None:
        """The server was told to stop (SIGTERM): requests still in flight `timeout` seconds from now fail with
        an error (a stream's error event and [DONE]) while their connections are still open."""
        if self._shutdown_timer is None:
            message = f"the server is shutting down: the request was cancelled after --shutdown-timeout {timeout:g} s"
            self._shutdown_timer = threading.Timer(timeout, self.cancel_all, (DraftsmithError(message),))
            self._shutdown_timer.daemon = True
            self._shutdown_timer.start()

    def cancel_all(self, exc: BaseException) -> None:
        """Fails every request in flight with `exc` and aborts them in the engine (shutdown's deadline)."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.fail(request_id, exc)
            self._send(AbortRequest(request_id))

    def _wait_unfinished(self, timeout: float) -> None:
        """Until nothing is in flight, `timeout` passes, or the engine stops serving."""
        deadline = time.monotonic() + timeout
        while self.num_unfinished() and time.monotonic() < deadline and self.healthy:
            time.sleep(0.05)
