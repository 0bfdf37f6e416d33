"""The engine in its own process, as vLLM's AsyncLLM runs its EngineCore: the API process parses, tokenises,
detokenises and streams; the engine process only steps. HTTP handling and the engine loop then never wait
on each other's GIL. The engine process runs the same `EngineLoop` as a thread engine; the two sides talk
in typed JSON frames (`frames`): the engine sends, per step, what each moved request gained since its last
report, and the API side merges that into vLLM's cumulative `RequestOutput`s as each request's reader takes
them (`output_streams`).

The API process supervises the engine process. Its dying (killed, out of memory, a crash in a kernel, or an
engine fault: `row_faults.EngineFault`, after which it exits with ENGINE_FAULT_EXIT) is seen as the pipe
closing: every request in flight fails at once with an error naming the exit code, and `/health` answers
503 while a fresh engine process loads. At most `max_restarts` restarts happen within RESTART_WINDOW_S;
the next death is fatal: `on_fatal` is called (`draftsmith serve` then exits with status 1, for a
supervisor such as systemd or Kubernetes to restart it) and the server answers 503 until then.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.serve.client.engine_client import EngineClient
from draftsmith.serve.client.engine_loop import EngineLoop
from draftsmith.serve.client.frames import (
    COMMANDS,
    REPORTS,
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    StepFailed,
    StepReport,
    StopEngine,
    recv,
    send,
)
from draftsmith.serve.client.frontend import Frontend
from draftsmith.serve.client.output_streams import DEFAULT_MAX_BACKLOG

logger = logging.getLogger("draftsmith")

STATS_EVERY_S = 0.25  # how often the engine reports its counters (Prometheus gauges) while busy
START_TIMEOUT_S = 600.0  # loading the weights and profiling forwards happen in the engine process
ENGINE_FAULT_EXIT = 70  # the engine process's exit status after an engine fault
RESTART_WINDOW_S = 600.0  # restarts counted against max_restarts


# ------------------------------------------------------------------------------------------ engine side
def engine_main(conn, llm_kwargs: dict, gate: bool = False) -> None:
    """The engine process: builds the LLM (with `gate`, then runs `draftsmith check`'s gate on the head it
    serves, on the target it loaded), then runs the engine loop over the pipe until told to stop or the API
    process goes away (the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    from draftsmith.serve.apps.llm import LLM

    passed = None
    try:
        llm = LLM(**llm_kwargs)
        if gate:
            from draftsmith.serve.check.cli import gate_served_head

            passed = gate_served_head(llm.engine.spec_config, Path(llm_kwargs["model"]), llm.model)
    except Exception as exc:  # a bad model folder or speculative config, a failed gate: the API process reports it
        send(conn, REPORTS, EngineFailed(str(exc) if isinstance(exc, DraftsmithError) else f"{type(exc).__name__}: {exc}"))
        return
    spec = llm.engine.spec_config
    send(conn, REPORTS, EngineReady(spec.num_speculative_tokens if spec else 0, llm.max_model_len, llm.vocab_size,
                                    llm.max_num_seqs, passed or ""))

    def receive(timeout: float) -> list:
        commands = []
        while conn.poll(0 if commands else timeout):
            commands.append(recv(conn, COMMANDS))
        return commands

    def fault(exc: Exception) -> None:
        logger.exception("engine fault; the engine process exits for a fresh one")
        send(conn, REPORTS, StepFailed(f"engine error: {exc}"))
        raise SystemExit(ENGINE_FAULT_EXIT) from None

    try:
        EngineLoop(llm.engine, receive, lambda report: send(conn, REPORTS, report), fault, STATS_EVERY_S).run()
    except (EOFError, OSError):  # the API process is gone: nothing left to serve
        pass


# --------------------------------------------------------------------------------------------- API side
class ProcessEngine(EngineClient):
    """An `EngineClient` over a supervised engine process."""

    def __init__(self, llm_kwargs: dict, max_queue: int = 256, observer=None, max_backlog: int = DEFAULT_MAX_BACKLOG,
                 max_restarts: int = 3, gate: bool = False):
        super().__init__(max_queue, max_backlog)
        self._gate = gate  # the first engine process gates the head it serves; a restarted one serves at once
        self.frontend: Frontend | None = None  # once the engine has loaded the model (`wait_ready`)
        self.llm_kwargs = llm_kwargs
        self.observer = observer  # called with (running, waiting, metrics) as the engine reports them
        self.max_restarts = max_restarts
        self.on_restart: Callable[[], None] | None = None  # after each restart (the metrics' counter)
        self.on_fatal: Callable[[str], None] | None = None  # the engine is dead for good (the server exits)
        self.restarted_at: list[float] = []
        # every command goes out through one writer thread: the event loop and the reader never block on a
        # full pipe (the engine process reads its commands only between steps)
        self._outbox: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write, name="draftsmith-engine-writer", daemon=True)
        self._dead: str | None = None
        self._restarting: str | None = None  # why, while a fresh engine process loads
        self._stopping = False
        self.num_speculative_tokens = 0
        self._spawn()
        self._reader: threading.Thread | None = None

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
        self._conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(child, self.llm_kwargs, self._gate),
                                       name="draftsmith-engine", daemon=True)
        self.process.start()
        child.close()
        self._gate = False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Blocks until the engine process has loaded the model; its load error becomes a DraftsmithError."""
        if not self._conn.poll(timeout):
            self.process.kill()
            raise DraftsmithError(f"the engine process did not start within {timeout:.0f} s")
        try:
            message = recv(self._conn, REPORTS)
        except EOFError:
            self.process.join(5)
            raise DraftsmithError(f"the engine process exited while starting (exit code {self.process.exitcode})") from None
        if isinstance(message, EngineFailed):
            self.process.join(5)
            raise DraftsmithError(message.message)
        if not isinstance(message, EngineReady):
            raise DraftsmithError(f"the engine process said {message.kind!r} before it was ready")
        self.num_speculative_tokens = message.num_speculative_tokens
        if message.gate:
            logger.info(message.gate)
        if self.frontend is None:
            self.frontend = Frontend.from_model_dir(self.llm_kwargs["model"], message.max_model_len,
                                                    message.vocab_size, message.max_num_seqs)

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._reader = threading.Thread(target=self._supervise, name="draftsmith-engine-reader", daemon=True)
        self._reader.start()
        self._writer.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._wait_unfinished(timeout)
        self._stopping = True
        self._send(StopEngine(0.0))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self.fail_all(DraftsmithError("server is shutting down"))

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._restarting is None and not self._stopping and self.process.is_alive()

    def unavailable_reason(self) -> str:
        if self._dead is not None:
            return self._dead
        if self._restarting is not None or not (self._stopping or self.process.is_alive()):
            return "the engine process died and is restarting; retry shortly"
        return "server is shutting down"

    def _send(self, command: AddRequest | AbortRequest | StopEngine) -> None:
        self._outbox.put(command)

    def _write(self) -> None:
        """The writer thread: posts each command to the engine process of the moment. An add whose stream has
        gone (failed, or left) is not sent; one the pipe refuses fails its stream (the engine died)."""
        while True:
            command = self._outbox.get()
            if isinstance(command, AddRequest) and command.request_id not in self._streams:
                continue
            try:
                send(self._conn, COMMANDS, command)
            except OSError:
                if isinstance(command, AddRequest):
                    self.fail(command.request_id, RuntimeError("the engine process died before taking the request"))

    # -------------------------------------------------------------------------------- supervisor thread
    def _supervise(self) -> None:
        """Reads the engine's reports; when the engine process dies, fails what was in flight and restarts it,
        or gives up (`on_fatal`) once max_restarts restarts happened within RESTART_WINDOW_S."""
        while True:
            self._read()
            if self._stopping:
                return
            self.process.join(timeout=5)
            reason = f"the engine process died (exit code {self.process.exitcode})"
            logger.error(reason)
            if self._restarts_left():  # /health and new requests answer 503 from here on, saying which
                self._restarting = reason
            else:
                self._dead = f"{reason}; the server cannot serve"
            self.fail_all(RuntimeError(reason))
            if self._dead is None and self._restart(reason):
                continue
            if self._stopping:  # shut down while restarting: not a death to report
                return
            self._dead = self._dead or f"{reason}; restarting failed, the server cannot serve"
            self._restarting = None
            logger.error("%s (%d restarts within %.0f s at most)", self._dead, self.max_restarts, RESTART_WINDOW_S)
            if self.on_fatal is not None:
                self.on_fatal(self._dead)
            return

    def _restarts_left(self) -> int:
        now = time.monotonic()
        self.restarted_at = [t for t in self.restarted_at if now - t < RESTART_WINDOW_S]
        return max(self.max_restarts - len(self.restarted_at), 0)

    def _restart(self, reason: str) -> bool:
        """Starts fresh engine processes until one loads or the restart budget is spent; True if one did."""
        while self._restarts_left() and not self._stopping:
            self.restarted_at.append(time.monotonic())
            logger.warning("%s: restarting it (restart %d of at most %d within %.0f s)", reason,
                           len(self.restarted_at), self.max_restarts, RESTART_WINDOW_S)
            try:
                self._spawn()
                self.wait_ready()
            except Exception as exc:  # a load error, or no process to be had: counts as another death
                reason = f"the engine process failed to restart: {exc}"
                logger.error(reason)
                continue
            self._restarting = None
            if self.on_restart is not None:
                self.on_restart()
            logger.warning("engine process restarted")
            return True
        return False

    def _read(self) -> None:
        """The engine's reports, until the pipe closes."""
        while True:
            try:
                report = recv(self._conn, REPORTS)
            except (EOFError, OSError):
                return
            if isinstance(report, StepFailed):
                self.fail_all(RuntimeError(report.message))
                continue
            self.take_report(report)
            if isinstance(report, StepReport) and report.stats is not None and self.observer is not None:
                try:
                    self.observer(report.stats.running, report.stats.waiting, report.stats.metrics)
                except Exception:  # metrics are not worth the reader thread
                    logger.exception("the metrics observer failed")


def start_engine_process(llm_kwargs: dict, max_queue: int = 256, observer=None,
                         max_backlog: int = DEFAULT_MAX_BACKLOG, max_restarts: int = 3,
                         gate: bool = False) -> ProcessEngine:
    """Starts the engine process for `LLM(**llm_kwargs)` and waits for its model to load (and, with `gate`,
    for its head to pass the acceptance gate); the API process loads only the tokenizer."""
    engine = ProcessEngine(llm_kwargs, max_queue, observer, max_backlog, max_restarts, gate)
    try:
        engine.wait_ready()
    except BaseException:
        engine.process.kill()
        raise
    return engine


__all__ = ["ProcessEngine", "engine_main", "start_engine_process"]
