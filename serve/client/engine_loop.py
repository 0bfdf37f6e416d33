"""The one loop that owns an engine, on a client's thread (`thread_engine`) or in an engine process
(`engine_process`): between steps it takes the client's commands (`frames`), and while requests are in
flight it steps the engine and reports what each request that moved gained.

What differs between the two clients is passed in: where commands come from (`receive`), where reports go
(`report`), and what an engine fault means (`on_fault`: a thread fails the requests in flight and goes on;
a process exits, for its supervisor to start a fresh one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from draftsmith.errors import DraftsmithError
from draftsmith.serve.client.frames import (
    AbortRequest,
    AddFailed,
    AddRequest,
    EngineStats,
    StepReport,
    StopEngine,
)
from draftsmith.serve.engine.checks import CheckedRequest

logger = logging.getLogger("draftsmith")

IDLE_WAIT_S = 0.5  # how long an idle loop waits for a command before looking again


def failure_of(request_id: str, exc: Exception) -> AddFailed:
    """What a request whose add raised `exc` fails with: a refusal (400) for its own mistake, else an engine
    error (500)."""
    if isinstance(exc, DraftsmithError):
        return AddFailed(request_id, str(exc), refused=True)
    return AddFailed(request_id, f"engine error while adding the request: {type(exc).__name__}: {exc}",
                         refused=False)


def engine_stats(engine) -> EngineStats:
    return EngineStats(len(engine.running), len(engine.waiting), engine.get_metrics())


class EngineLoop:
    """Steps `engine` for a client until told to stop.

    Args:
        receive: the commands that came, waiting up to the given seconds for the first.
        report: takes each step's report (and one with no deltas and fresh stats when the engine goes idle).
        on_fault: called with what a step raised; it may raise to end the loop.
        stats_every_s: how often a busy loop's reports carry the engine's counters (0: every step).
    """

    def __init__(self, engine, receive: Callable[[float], list], report: Callable[[StepReport | AddFailed], None],
                 on_fault: Callable[[Exception], None], stats_every_s: float = 0.0):
        self.engine = engine
        self.receive, self.report, self.on_fault = receive, report, on_fault
        self.stats_every_s = stats_every_s
        self.last_stats = float("-inf")  # never: the first report carries them, however long the machine is up
        self.stop_at: float | None = None
        self.idle_reported = True

    def run(self) -> None:
        engine = self.engine
        while True:
            for command in self.receive(0 if engine.has_unfinished_requests() else IDLE_WAIT_S):
                self.take(command)
            if self.stop_at is not None and (not engine.has_unfinished_requests() or time.monotonic() > self.stop_at):
                return
            if not engine.has_unfinished_requests():
                if not self.idle_reported:  # once per idle spell: the gauges fall to 0, then quiet
                    self.report(StepReport([], self._stats(force=True)))
                    self.idle_reported = True
                continue
            self.idle_reported = False
            try:
                deltas = engine.step()
            except Exception as exc:  # requests fail alone inside the step: what reaches here is the engine's
                self.on_fault(exc)
                continue
            self.report(StepReport(deltas, self._stats(force=False)))

    def take(self, command: AddRequest | AbortRequest | StopEngine) -> None:
        if isinstance(command, AddRequest):
            checked = CheckedRequest(command.prompt_token_ids, command.params, command.prompt)  # at the edge
            try:
                self.engine.add(checked, request_id=command.request_id)
            except Exception as exc:  # fails alone: a refusal (400) or an engine error (500)
                self.report(failure_of(command.request_id, exc))
        elif isinstance(command, AbortRequest):
            self.engine.abort_request(command.request_id)
        else:
            self.stop_at = time.monotonic() + command.grace_s

    def abort_all(self) -> None:
        """Aborts every request the engine holds (after an engine fault on a thread)."""
        for request in list(self.engine.running) + list(self.engine.waiting):
            try:
                self.engine.abort_request(request.request_id)
            except Exception:  # an abort that raises still leaves the request unserved; go on with the rest
                logger.exception("aborting request %s failed", request.request_id)

    def _stats(self, force: bool) -> EngineStats | None:
        now = time.monotonic()
        if not force and now - self.last_stats < self.stats_every_s:
            return None
        self.last_stats = now
        return engine_stats(self.engine)
