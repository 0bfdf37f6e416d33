"""The engine behind the HTTP server: one loop thread steps the engine for every request.

All engine mutations (add, abort, step) happen on the loop thread; the asyncio side only enqueues commands
and reads per-request output streams (`output_streams`), so no engine state is shared across threads. A
request the engine cannot take, or one it fails alone (`row_faults`), fails alone; if a step itself raises
(an engine fault), or anything else on the loop thread does, the requests in flight get the error and the
loop goes on with an empty engine.

`AsyncEngine` is also the base of `engine_process.ProcessEngine`: what the two share is here (submitting,
the queue bound, the streams, cancelling what is in flight at shutdown).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from draftsmith.errors import DraftsmithError
from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.client.output_streams import (
    DEFAULT_MAX_BACKLOG,
    DeltaTracker,
    OutputDelta,
    OutputStream,
)
from draftsmith.serve.engine.request import RequestOutput
from draftsmith.serve.engine.sampling_params import SamplingParams

logger = logging.getLogger("draftsmith")


class QueueFullError(DraftsmithError):
    """More requests are waiting than --max-queue allows, or the engine is not taking requests (503)."""


class RequestRejected(DraftsmithError):
    """The engine refused the request when it was added (400)."""


def refusal(exc: Exception) -> Exception:
    """What a request whose add raised `exc` fails with: a refusal (400) for its own mistake, else an engine
    error (500)."""
    if isinstance(exc, DraftsmithError):
        return RequestRejected(str(exc))
    return RuntimeError(f"engine error while adding the request: {type(exc).__name__}: {exc}")


class RequestOutputs:
    """What `submit` returns: an async iterator over a request's cumulative outputs. Leaving it before the
    request finished (closing it, an exception or cancellation while reading, or dropping it unread) aborts
    the request, which frees its slot."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: OutputStream):
        self.engine, self.request_id, self.stream = engine, request_id, stream
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
        """Aborts the request unless the engine already finished or failed it (idempotent, takes no lock: the
        consuming thread forgets the stream when it takes the abort)."""
        if not self._left:
            self._left = True
            if not self.stream.closed:
                self.engine._send(("abort", self.request_id))

    def __del__(self):
        try:
            self.abort()
        except Exception:  # an engine torn down already (interpreter exit): nothing left to abort
            pass


class AsyncEngine:
    def __init__(self, llm: LLM, max_queue: int = 256, observer=None, max_backlog: int = DEFAULT_MAX_BACKLOG):
        self._init_streams(max_queue, max_backlog)
        self.frontend = llm
        self.engine = llm.engine
        self.observer = observer  # called on the loop thread after every step (metrics)
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftsmith-engine", daemon=True)
        self._tracker = DeltaTracker()

    def _init_streams(self, max_queue: int, max_backlog: int) -> None:
        self.max_queue = max_queue
        self.max_backlog = max_backlog
        self._streams: dict[str, OutputStream] = {}  # in flight, in the order they came (the engine's)
        self._lock = threading.Lock()
        self._ids = 0
        self._shutdown_timer: threading.Timer | None = None

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finishes in-flight work for up to `timeout` seconds, then cancels the rest."""
        self._wait_unfinished(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def begin_shutdown(self, timeout: float) -> None:
        """The server was told to stop (SIGTERM): requests still in flight `timeout` seconds from now fail with
        an error (a stream's error event and [DONE]) while their connections are still open."""
        if self._shutdown_timer is None:
            message = f"the server is shutting down: the request was cancelled after --shutdown-timeout {timeout:g} s"
            self._shutdown_timer = threading.Timer(timeout, self.cancel_all, (DraftsmithError(message),))
            self._shutdown_timer.daemon = True
            self._shutdown_timer.start()

    def _wait_unfinished(self, timeout: float) -> None:
        """Until nothing is in flight, `timeout` passes, or the engine stops serving."""
        deadline = time.monotonic() + timeout
        while self.num_unfinished() and time.monotonic() < deadline and self.healthy:
            time.sleep(0.05)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    # -------------------------------------------------------------------------------------- requests
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None) -> RequestOutputs:
        """Queues a request (raising at once if it is invalid or the queue is full) and returns an async
        iterator over its outputs; leaving the iterator early aborts the request and frees its slot."""
        self.frontend.check_prompt(prompt_token_ids)
        self.frontend.check_samples(params)
        with self._lock:  # checked under the lock: a supervisor failing every stream sees this one or refuses it
            if not self.healthy:
                raise QueueFullError(self.unavailable_reason())
            if self._waiting_for_slots(params.n) > self.max_queue:
                raise QueueFullError(f"server queue is full ({self.max_queue} waiting requests); retry later")
            self._ids += 1
            request_id = f"req-{self._ids}"
            stream = OutputStream(request_id, params.n, prompt, prompt_token_ids, self.max_backlog, self._cut_off)
            self._streams[request_id] = stream
        self._send(("add", request_id, prompt_token_ids, params, prompt))
        return RequestOutputs(self, request_id, stream)

    def unavailable_reason(self) -> str:
        return "server is shutting down"

    def _waiting_for_slots(self, n: int) -> int:
        """How many in-flight requests, with one more of `n` samples, would wait for cache slots (under the
        lock; --max-queue bounds it): the engine admits first come first served while a request's samples fit the free slots, so
        every request from the first that does not fit waits."""
        free, waiting = self.frontend.max_num_seqs, 0
        for takes in [s.n for s in self._streams.values()] + [n]:
            if waiting or takes > free:
                waiting += 1
            else:
                free -= takes
        return waiting

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _cut_off(self, request_id: str) -> None:
        """A stream's reader left too much unread (`OutputStream`): abort its request, free its slot."""
        logger.warning("request %s: its client is not reading its stream; aborting it", request_id)
        self._send(("abort", request_id))

    def cancel_all(self, exc: BaseException) -> None:
        """Fails every request in flight with `exc` and aborts them in the engine (shutdown's deadline)."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._fail(request_id, exc)
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _push(self, delta: OutputDelta) -> None:
        """Hands a request's delta to its stream (dropped if the request was aborted meanwhile)."""
        with self._lock:
            stream = self._streams.get(delta.request_id)
            if stream is not None and (delta.finished or delta.error is not None):
                del self._streams[delta.request_id]
        if stream is not None:
            stream.push(delta)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.fail(exc)

    # ------------------------------------------------------------------------------------ loop thread
    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, ids, params, prompt = command
                if request_id not in self._streams:  # failed or left before the loop took it
                    continue
                try:
                    self.engine.add_request(ids, params, request_id=request_id, prompt=prompt)
                except Exception as exc:
                    self._fail(request_id, refusal(exc))
            else:
                self._forget(command[1])
                self.engine.abort_request(command[1])
                self._tracker.forget(command[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:  # an engine fault, not a request's: fail what is in flight, keep serving
                logger.exception("engine loop failed; failing the requests in flight")
                self._fail_all(RuntimeError(f"engine error: {exc}"))
        self._fail_all(DraftsmithError("server is shutting down"))

    def _turn(self) -> None:
        """Takes the queued commands, then steps the engine once (or waits for work)."""
        self._drain_commands()
        if not self.engine.has_unfinished_requests():
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            return
        outputs = self.engine.step()
        for output in outputs:
            self._push(self._tracker.delta(output))
        if self.observer is not None:
            self.observer(self.engine)

    def _fail_all(self, exc: BaseException) -> None:
        for request in list(self.engine.running) + list(self.engine.waiting):
            try:
                self.engine.abort_request(request.request_id)
            except Exception:  # an abort that raises still leaves the request unserved; go on with the rest
                logger.exception("aborting request %s failed", request.request_id)
        self._tracker.clear()
        with self._lock:
            leftovers = list(self._streams)
        for request_id in leftovers:
            self._fail(request_id, exc)
