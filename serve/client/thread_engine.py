"""The engine on a thread of the server's process: one loop thread (`EngineLoop`) owns it and steps it for
every request. All engine mutations (add, abort, step) happen on that thread; the asyncio side only
enqueues commands and reads per-request output streams, so no engine state is shared across threads.

If a step raises (an engine fault), or anything else on the loop thread does, the requests in flight get the
error and the loop goes on with an empty engine.
"""

from __future__ import annotations

import logging
import queue
import threading

from draftsmith.errors import DraftsmithError
from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.client.engine_client import EngineClient
from draftsmith.serve.client.engine_loop import EngineLoop
from draftsmith.serve.client.frames import AddRequest, StepReport, StopEngine
from draftsmith.serve.client.output_streams import DEFAULT_MAX_BACKLOG

logger = logging.getLogger("draftsmith")


class ThreadEngine(EngineClient):
    """An `EngineClient` over `llm.engine`, stepped on a thread of this process.

    Args:
        observer: called on the loop thread with (running, waiting, metrics) after every step (the metrics).
    """

    def __init__(self, llm: LLM, max_queue: int = 256, observer=None, max_backlog: int = DEFAULT_MAX_BACKLOG):
        super().__init__(max_queue, max_backlog)
        self.frontend = llm
        self.engine = llm.engine
        self.observer = observer
        self._commands: queue.Queue = queue.Queue()
        self._stopping = False
        self._loop = EngineLoop(self.engine, self._receive, self._report, self._fault)
        self._thread = threading.Thread(target=self._run, name="draftsmith-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._wait_unfinished(timeout)
        self._stopping = True
        self._send(StopEngine(0.0))
        self._thread.join(timeout=5)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def unavailable_reason(self) -> str:
        return "server is shutting down"

    def _send(self, command) -> None:
        self._commands.put(command)

    # ------------------------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        while True:
            try:
                self._loop.run()
                break  # told to stop
            except Exception as exc:  # anything else on the loop thread: as an engine fault
                self._fault(exc)
        self._loop.abort_all()
        self.fail_all(DraftsmithError("server is shutting down"))

    def _receive(self, timeout: float) -> list:
        """The queued commands, waiting up to `timeout` for the first; an add whose stream has gone (failed or
        left before the loop took it) is dropped."""
        try:
            commands = [self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        return [c for c in commands if not isinstance(c, AddRequest) or c.request_id in self._streams]

    def _report(self, report) -> None:
        self.take_report(report)
        if isinstance(report, StepReport) and report.stats is not None and self.observer is not None:
            stats = report.stats
            self.observer(stats.running, stats.waiting, stats.metrics)

    def _fault(self, exc: Exception) -> None:
        logger.exception("engine fault; failing the requests in flight")
        self._loop.abort_all()
        self.fail_all(RuntimeError(f"engine error: {exc}"))
