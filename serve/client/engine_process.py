"""The engine in its own process, as vLLM's AsyncLLM runs its EngineCore: the API process parses, tokenises,
detokenises and streams; the engine process only steps. HTTP handling and the engine loop then never wait
on each other's GIL. They talk in JSON frames (`engine_frames`): the engine sends, per step, what each moved
request gained since its last report, and the API side merges that into vLLM's cumulative `RequestOutput`s
as each request's reader takes them (`output_streams`).

The API process supervises the engine process. Its dying (killed, out of memory, a crash in a kernel, or an
engine fault: `row_faults.EngineFault`, after which it exits with ENGINE_FAULT_EXIT) is seen as the pipe
closing: every request in flight fails at once with an error naming the exit code, and `/health` answers
503 while a fresh engine process loads. At most `max_restarts` restarts happen within RESTART_WINDOW_S;
the next death is fatal: `on_fatal` is called (`draftsmith serve` then exits with status 1, for a
supervisor such as systemd or Kubernetes to restart it) and the server answers 503 until then.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable

from draftsmith.errors import DraftsmithError
from draftsmith.serve.client.async_engine import AsyncEngine, QueueFullError, RequestRejected, refusal
from draftsmith.serve.client.frames import delta_frame, delta_from_frame, recv, send
from draftsmith.serve.client.frontend import Frontend
from draftsmith.serve.client.output_streams import DEFAULT_MAX_BACKLOG, DeltaTracker
from draftsmith.serve.engine.sampling_params import SamplingParams

logger = logging.getLogger("draftsmith")

STATS_EVERY_S = 0.25  # how often the engine reports its counters (Prometheus gauges) while busy
START_TIMEOUT_S = 600.0  # loading the weights and profiling forwards happen in the engine process
ENGINE_FAULT_EXIT = 70  # the engine process's exit status after an engine fault
RESTART_WINDOW_S = 600.0  # restarts counted against max_restarts


# ------------------------------------------------------------------------------------------ engine side
def engine_main(conn, llm_kwargs: dict) -> None:
    """The engine process: builds the LLM, then steps it and answers commands until told to stop or the API
    process goes away (the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    from draftsmith.serve.apps.llm import LLM

    try:
        llm = LLM(**llm_kwargs)
    except Exception as exc:  # a bad model folder or speculative config: the API process reports it
        send(conn, {"failed": str(exc) if isinstance(exc, DraftsmithError) else f"{type(exc).__name__}: {exc}"})
        return
    spec = llm.engine.spec_config
    send(conn, {"ready": {"num_speculative_tokens": spec.num_speculative_tokens if spec else 0,
                          "max_model_len": llm.max_model_len, "vocab_size": llm.vocab_size,
                          "max_num_seqs": llm.max_num_seqs}})
    try:
        _EngineLoop(llm.engine, conn).run()
    except (EOFError, OSError):  # the API process is gone: nothing left to serve
        pass


class _EngineLoop:
    def __init__(self, engine, conn):
        self.engine = engine
        self.conn = conn
        self.tracker = DeltaTracker()
        self.last_stats = 0.0
        self.stopping_at: float | None = None
        self.idle_reported = True

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if self.conn.poll(0 if busy else 0.5):
                self._commands()
            if self.stopping_at is not None and (not engine.has_unfinished_requests()
                                                 or time.monotonic() > self.stopping_at):
                return
            if not engine.has_unfinished_requests():
                if not self.idle_reported:  # once per idle spell: the gauges fall to 0, then quiet
                    send(self.conn, {"out": [], "stats": self._stats(force=True)})
                    self.idle_reported = True
                continue
            self.idle_reported = False
            try:
                outputs = engine.step()
            except Exception as exc:  # requests fail alone inside the step: what reaches here is the engine's
                logger.exception("engine fault; the engine process exits for a fresh one")
                send(self.conn, {"step_failed": f"engine error: {exc}"})
                raise SystemExit(ENGINE_FAULT_EXIT) from None
            frames = [delta_frame(self.tracker.delta(o)) for o in outputs]
            send(self.conn, {"out": frames, "stats": self._stats(force=False)})

    def _commands(self) -> None:
        while self.conn.poll(0):
            command = recv(self.conn)
            op = command[0]
            if op == "add":
                _, request_id, ids, params, prompt = command
                try:
                    self.engine.add_request(ids, SamplingParams(**params), request_id=request_id, prompt=prompt)
                except Exception as exc:  # fails alone: a refusal (400) or an engine error (500)
                    failure = refusal(exc)
                    send(self.conn, {"rejected": request_id, "message": str(failure),
                                     "refused": isinstance(failure, RequestRejected)})
            elif op == "abort":
                self.engine.abort_request(command[1])
                self.tracker.forget(command[1])
            elif op == "stop":
                self.stopping_at = time.monotonic() + command[1]

    def _stats(self, force: bool) -> dict | None:
        """The engine's counts and counters for the API side's Prometheus gauges: every STATS_EVERY_S while
        busy (None between), or now."""
        now = time.monotonic()
        if not force and now - self.last_stats < STATS_EVERY_S:
            return None
        self.last_stats = now
        return {"running": len(self.engine.running), "waiting": len(self.engine.waiting),
                "metrics": self.engine.get_metrics()}


# --------------------------------------------------------------------------------------------- API side
class ProcessEngine(AsyncEngine):
    """`AsyncEngine`'s interface (submit, streams, abort on leaving, shutdown) over a supervised engine
    process."""

    def __init__(self, llm_kwargs: dict, max_queue: int = 256, observer=None, max_backlog: int = DEFAULT_MAX_BACKLOG,
                 max_restarts: int = 3):
        self._init_streams(max_queue, max_backlog)
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
        self.process = context.Process(target=engine_main, args=(child, self.llm_kwargs), name="draftsmith-engine",
                                       daemon=True)
        self.process.start()
        child.close()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Blocks until the engine process has loaded the model; its load error becomes a DraftsmithError."""
        if not self._conn.poll(timeout):
            self.process.kill()
            raise DraftsmithError(f"the engine process did not start within {timeout:.0f} s")
        try:
            message = recv(self._conn)
        except EOFError:
            self.process.join(5)
            raise DraftsmithError(f"the engine process exited while starting (exit code {self.process.exitcode})") from None
        if "failed" in message:
            self.process.join(5)
            raise DraftsmithError(message["failed"])
        ready = message["ready"]
        self.num_speculative_tokens = ready["num_speculative_tokens"]
        if self.frontend is None:
            self.frontend = Frontend.from_model_dir(self.llm_kwargs["model"], ready["max_model_len"],
                                                    ready["vocab_size"], ready["max_num_seqs"])

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._reader = threading.Thread(target=self._supervise, name="draftsmith-engine-reader", daemon=True)
        self._reader.start()
        self._writer.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._wait_unfinished(timeout)
        self._stopping = True
        self._send(("stop", 0.0))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self._fail_all(DraftsmithError("server is shutting down"))

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._restarting is None and not self._stopping and self.process.is_alive()

    def unavailable_reason(self) -> str:
        if self._dead is not None:
            return self._dead
        if self._restarting is not None or not (self._stopping or self.process.is_alive()):
            return "the engine process died and is restarting; retry shortly"
        return "server is shutting down"

    def _send(self, command: tuple) -> None:
        self._outbox.put(command)

    def _write(self) -> None:
        """The writer thread: posts each command to the engine process of the moment. An add whose stream has
        gone (failed, or left) is not sent; one the pipe refuses fails its stream (the engine died)."""
        while True:
            command = self._outbox.get()
            if command[0] == "abort":
                self._forget(command[1])
            elif command[0] == "add":
                _, request_id, ids, params, prompt = command
                if request_id not in self._streams:
                    continue
                command = ("add", request_id, list(ids), dataclasses.asdict(params), prompt)
            try:
                send(self._conn, command)
            except OSError:
                if command[0] == "add":
                    self._fail(command[1], RuntimeError("the engine process died before taking the request"))

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
            self._fail_all(RuntimeError(reason))
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
                message = recv(self._conn)
            except (EOFError, OSError):
                return
            if "out" in message:
                for frame in message["out"]:
                    self._push(delta_from_frame(frame))
                stats = message.get("stats")
                if stats is not None and self.observer is not None:
                    try:
                        self.observer(stats["running"], stats["waiting"], stats["metrics"])
                    except Exception:  # metrics are not worth the reader thread
                        logger.exception("the metrics observer failed")
            elif "rejected" in message:
                failure = RequestRejected if message.get("refused", True) else RuntimeError
                self._fail(message["rejected"], failure(message["message"]))
            elif "step_failed" in message:
                self._fail_all(RuntimeError(message["step_failed"]))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            leftovers = list(self._streams)
        for request_id in leftovers:
            self._fail(request_id, exc)


def start_engine_process(llm_kwargs: dict, max_queue: int = 256, observer=None,
                         max_backlog: int = DEFAULT_MAX_BACKLOG, max_restarts: int = 3) -> ProcessEngine:
    """Starts the engine process for `LLM(**llm_kwargs)` and waits for its model to load; the API process
    loads only the tokenizer."""
    engine = ProcessEngine(llm_kwargs, max_queue, observer, max_backlog, max_restarts)
    try:
        engine.wait_ready()
    except BaseException:
        engine.process.kill()
        raise
    return engine


__all__ = ["ProcessEngine", "QueueFullError", "engine_main", "start_engine_process"]
