"""The engine in its own process, as vLLM's AsyncLLM runs its EngineCore: the API process parses, tokenises,
detokenises and streams; the engine process only steps. HTTP handling and the engine loop then never wait
on each other's GIL.

They talk over a `multiprocessing` pipe: each message is one length-prefixed frame (`send_bytes`) of JSON,
never pickle, so a frame can only ever be data. The engine sends, per step, what each moved request gained
since its last report (new token ids and logprobs, a finished sample's text and reasons), not the whole
output again; the API side rebuilds vLLM's cumulative `RequestOutput`s from them.

The engine process dying (killed, out of memory, a crash in a kernel) is seen as the pipe closing: every
request in flight fails at once with an error naming the exit code, `/health` turns 503 and new requests are
refused, instead of hanging.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import signal
import threading
import time

from draftsmith.errors import DraftsmithError
from draftsmith.serve.async_engine import AsyncEngine, QueueFullError, _Stream
from draftsmith.serve.frontend import Frontend
from draftsmith.serve.logprobs import Logprob
from draftsmith.serve.request import CompletionOutput, RequestOutput
from draftsmith.serve.sampling_params import SamplingParams

logger = logging.getLogger("draftsmith")

STATS_EVERY_S = 0.25  # how often the engine reports its counters (Prometheus gauges) while busy
START_TIMEOUT_S = 600.0  # loading the weights and profiling forwards happen in the engine process


def _send(conn, message) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn):
    return json.loads(conn.recv_bytes())


def _entries(entries: list[dict] | None) -> list | None:
    """Logprob entries ({token: Logprob}, in order) as JSON: [[token, logprob, rank], ...] each."""
    if entries is None:
        return None
    return [None if e is None else [[t, lp.logprob, lp.rank] for t, lp in e.items()] for e in entries]


def _from_entries(entries: list | None) -> list[dict | None] | None:
    if entries is None:
        return None
    return [None if e is None else {t: Logprob(lp, rank) for t, lp, rank in e} for e in entries]


# ------------------------------------------------------------------------------------------ engine side
def engine_main(conn, llm_kwargs: dict) -> None:
    """The engine process: builds the LLM, then steps it and answers commands until told to stop or the API
    process goes away (the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    from draftsmith.serve.llm import LLM

    try:
        llm = LLM(**llm_kwargs)
    except Exception as exc:  # a bad model folder or speculative config: the API process reports it
        _send(conn, {"failed": str(exc) if isinstance(exc, DraftsmithError) else f"{type(exc).__name__}: {exc}"})
        return
    spec = llm.engine.spec_config
    _send(conn, {"ready": {"num_speculative_tokens": spec.num_speculative_tokens if spec else 0,
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
        self.sent: dict[str, dict[int, int]] = {}  # request id -> sample index -> tokens reported
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
                    _send(self.conn, {"out": [], "stats": self._stats(force=True)})
                    self.idle_reported = True
                continue
            self.idle_reported = False
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug, not a user error: fail what is in flight, keep serving
                logger.exception("engine step failed; failing the requests in flight")
                for request in list(engine.running) + list(engine.waiting):
                    engine.abort_request(request.request_id)
                self.sent.clear()
                _send(self.conn, {"step_failed": f"engine error: {exc}"})
                continue
            _send(self.conn, {"out": [self._delta(o) for o in outputs], "stats": self._stats(force=False)})

    def _commands(self) -> None:
        while self.conn.poll(0):
            command = _recv(self.conn)
            op = command[0]
            if op == "add":
                _, request_id, ids, params, prompt = command
                try:
                    self.engine.add_request(ids, SamplingParams(**params), request_id=request_id, prompt=prompt)
                except DraftsmithError as exc:
                    _send(self.conn, {"rejected": request_id, "message": str(exc)})
            elif op == "abort":
                self.engine.abort_request(command[1])
                self.sent.pop(command[1], None)
            elif op == "stop":
                self.stopping_at = time.monotonic() + command[1]

    def _delta(self, output: RequestOutput) -> list:
        """What `output` adds to what its request reported before: [id, finished, prompt logprobs (first report
        only), [[index, new token ids, their logprobs, final text, finish reason, stop reason], ...]]."""
        first = output.request_id not in self.sent
        sent = self.sent.setdefault(output.request_id, {})
        samples = []
        for c in output.outputs:
            start = sent.get(c.index, 0)
            sent[c.index] = len(c.token_ids)
            done = c.finish_reason is not None
            samples.append([c.index, c.token_ids[start:], _entries(c.logprobs[start:]) if c.logprobs is not None
                            else None, c.text if done else None, c.finish_reason, c.stop_reason])
        if output.finished:
            del self.sent[output.request_id]
        return [output.request_id, output.finished, _entries(output.prompt_logprobs) if first else None, samples]

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
@dataclasses.dataclass
class _Accumulated:
    """A request's output as the API side rebuilds it from the engine's reports."""

    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[CompletionOutput]
    prompt_logprobs: list | None = None

    def add(self, request_id: str, finished: bool, prompt_logprobs, samples: list) -> RequestOutput:
        if prompt_logprobs is not None:
            self.prompt_logprobs = _from_entries(prompt_logprobs)
        for index, new_ids, new_logprobs, text, finish_reason, stop_reason in samples:
            sample = self.samples[index]
            sample.token_ids = sample.token_ids + new_ids
            if new_logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + _from_entries(new_logprobs)
            if text is not None:
                sample.text = text
            sample.finish_reason, sample.stop_reason = finish_reason, stop_reason
        # new lists each time: the consumer reads this output while the next report comes in
        return RequestOutput(request_id, self.prompt, self.prompt_token_ids, [dataclasses.replace(s) for s in self.samples],
                             finished, None if self.prompt_logprobs is None else list(self.prompt_logprobs))


class ProcessEngine(AsyncEngine):
    """`AsyncEngine`'s interface (submit, streams, abort on leaving, shutdown) over an engine process."""

    def __init__(self, llm_kwargs: dict, max_queue: int = 256, observer=None):
        self.frontend: Frontend | None = None  # once the engine has loaded the model (`wait_ready`)
        self.llm_kwargs = llm_kwargs
        self.max_queue = max_queue
        self.observer = observer  # called with (running, waiting, metrics) as the engine reports them
        self._streams: dict[str, _Stream] = {}
        self._outputs: dict[str, _Accumulated] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = 0
        self._pending = 0  # AsyncEngine's count of adds not yet taken by its thread: unused here (`_queued`)
        self._running = 0  # as last reported
        self._dead: str | None = None
        self._stopping = False
        self.num_speculative_tokens = 0
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
        self._conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(child, llm_kwargs), name="draftsmith-engine",
                                       daemon=True)
        self.process.start()
        child.close()
        self._reader: threading.Thread | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Blocks until the engine process has loaded the model; its load error becomes a DraftsmithError."""
        if not self._conn.poll(timeout):
            self.process.kill()
            raise DraftsmithError(f"the engine process did not start within {timeout:.0f} s")
        try:
            message = _recv(self._conn)
        except EOFError:
            self.process.join(5)
            raise DraftsmithError(f"the engine process exited while starting (exit code {self.process.exitcode})") from None
        if "failed" in message:
            self.process.join(5)
            raise DraftsmithError(message["failed"])
        ready = message["ready"]
        self.num_speculative_tokens = ready["num_speculative_tokens"]
        self.frontend = Frontend.from_model_dir(self.llm_kwargs["model"], ready["max_model_len"], ready["vocab_size"],
                                                ready["max_num_seqs"])

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="draftsmith-engine-reader", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.num_unfinished() and time.monotonic() < deadline and self._dead is None:
            time.sleep(0.05)
        self._stopping = True
        if self._dead is None:
            try:
                self._post(("stop", 0.0))
            except OSError:
                pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self._fail_all(DraftsmithError("server is shutting down"))

    @property
    def healthy(self) -> bool:
        return self._dead is None and not self._stopping and self.process.is_alive()

    def _queued(self) -> int:
        return max(len(self._streams) - self._running, 0)

    def submit(self, prompt_token_ids, params, prompt=None):
        if self._dead is not None:
            raise QueueFullError(self._dead)
        return super().submit(prompt_token_ids, params, prompt)

    def _send(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, ids, params, prompt = command
            self._outputs[request_id] = _Accumulated(
                prompt, list(ids), [CompletionOutput(i, "", [], None) for i in range(params.n)])
            command = ("add", request_id, list(ids), dataclasses.asdict(params), prompt)
        elif command[0] == "abort":
            with self._lock:
                self._streams.pop(command[1], None)
            self._outputs.pop(command[1], None)
        try:
            self._post(command)
        except OSError:  # the engine is gone: the reader fails the streams
            pass

    def _post(self, command: tuple) -> None:
        with self._send_lock:
            self._conn.send_bytes(json.dumps(command).encode())

    # ---------------------------------------------------------------------------------- reader thread
    def _read(self) -> None:
        while True:
            try:
                message = _recv(self._conn)
            except (EOFError, OSError):
                break
            if "out" in message:
                for request_id, finished, prompt_logprobs, samples in message["out"]:
                    accumulated = self._outputs.get(request_id)
                    if accumulated is None:  # aborted meanwhile
                        continue
                    output = accumulated.add(request_id, finished, prompt_logprobs, samples)
                    if finished:
                        self._outputs.pop(request_id, None)
                    self._deliver(request_id, output)
                stats = message.get("stats")
                if stats is not None:
                    self._running = stats["running"]
                    if self.observer is not None:
                        self.observer(stats["running"], stats["waiting"], stats["metrics"])
            elif "rejected" in message:
                self._outputs.pop(message["rejected"], None)
                self._deliver(message["rejected"], DraftsmithError(message["message"]))
            elif "step_failed" in message:
                self._fail_all(RuntimeError(message["step_failed"]))
        if not self._stopping:
            self.process.join(timeout=5)
            self._dead = f"the engine process died (exit code {self.process.exitcode}); the server cannot serve"
            logger.error(self._dead)
            self._fail_all(RuntimeError(self._dead))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            leftovers = list(self._streams)
        for request_id in leftovers:
            self._outputs.pop(request_id, None)
            self._deliver(request_id, exc)


def start_engine_process(llm_kwargs: dict, max_queue: int = 256, observer=None) -> ProcessEngine:
    """Starts the engine process for `LLM(**llm_kwargs)` and waits for its model to load; the API process
    loads only the tokenizer."""
    engine = ProcessEngine(llm_kwargs, max_queue, observer)
    try:
        engine.wait_ready()
    except BaseException:
        engine.process.kill()
        raise
    return engine


__all__ = ["ProcessEngine", "QueueFullError", "engine_main", "start_engine_process"]
