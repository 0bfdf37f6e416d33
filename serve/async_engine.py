"""The engine behind the HTTP server: one loop thread steps the engine for every request.

All engine mutations (add, abort, step) happen on the loop thread; the asyncio side only enqueues
commands and reads per-request output queues, so no engine state is shared across threads. A request
that fails validation fails alone; if a step itself raises, the requests in flight get the error and
the loop goes on with an empty engine, so the server never dies from a request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from draftsmith.errors import DraftsmithError
from draftsmith.serve.llm import LLM
from draftsmith.serve.request import RequestOutput
from draftsmith.serve.sampling_params import SamplingParams

logger = logging.getLogger("draftsmith")


class QueueFullError(DraftsmithError):
    """More requests are waiting than --max-queue allows."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue  # RequestOutput | BaseException


class AsyncEngine:
    def __init__(self, llm: LLM, max_queue: int = 256, observer=None):
        self.frontend = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.observer = observer  # called on the loop thread after every step (metrics)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # submitted, not yet admitted by the loop thread
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftsmith-engine", daemon=True)
        self._ids = 0

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finishes in-flight work for up to `timeout` seconds, then cancels the rest."""
        deadline = time.monotonic() + timeout
        while self.num_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    # -------------------------------------------------------------------------------------- requests
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queues a request (raising at once if it is invalid or the queue is full) and returns an async
        iterator over its outputs; leaving the iterator early aborts the request and frees its slot."""
        if not self.healthy:
            raise QueueFullError("server is shutting down")
        self.frontend.check_prompt(prompt_token_ids)
        self.frontend.check_samples(params)
        with self._lock:
            if self._queued() >= self.max_queue:
                raise QueueFullError(f"server queue is full ({self.max_queue} waiting requests); retry later")
            self._ids += 1
            request_id = f"req-{self._ids}"
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
            self._streams[request_id] = stream
            self._pending += 1
        self._send(("add", request_id, prompt_token_ids, params, prompt))
        return self._iterate(request_id, stream)

    def _queued(self) -> int:
        """Requests waiting for a slot, or on their way to the engine (under the lock)."""
        return len(self.engine.waiting) + self._pending

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # client went away or the handler was cancelled
                self._send(("abort", request_id))

    # ------------------------------------------------------------------------------------ loop thread
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, ids, params, prompt = command
                with self._lock:
                    self._pending -= 1
                try:
                    self.engine.add_request(ids, params, request_id=request_id, prompt=prompt)
                except DraftsmithError as exc:
                    self._deliver(request_id, exc)
            else:
                self.engine.abort_request(command[1])
                with self._lock:
                    self._streams.pop(command[1], None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug, not a user error: fail what is in flight, keep serving
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(RuntimeError(f"engine error: {exc}"))
                continue
            for output in outputs:
                self._deliver(output.request_id, output)
            if self.observer is not None:
                self.observer(self.engine)
        self._fail_all(DraftsmithError("server is shutting down"))

    def _fail_all(self, exc: BaseException) -> None:
        for request in list(self.engine.running) + list(self.engine.waiting):
            self.engine.abort_request(request.request_id)
            self._deliver(request.output_id, exc)
        with self._lock:
            leftovers = list(self._streams)
        for request_id in leftovers:
            self._deliver(request_id, exc)
