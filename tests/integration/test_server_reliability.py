"""No request can take the server down (the failures of a reliability run, each one a test): parameters that
used to kill or fail the engine, oversized bodies, invalid Unicode, clients that never read, a burst that
fits the queue, a dead engine process (restarted, or the server exits), and shutdown past its timeout. A
canary stream runs beside the bad requests and must answer exactly what plain decoding answers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.apps.demo import wait_healthy
from draftsmith.serve.client.engine_client import QueueFullError
from draftsmith.serve.client.output_streams import BacklogFull
from draftsmith.serve.client.thread_engine import ThreadEngine
from draftsmith.serve.engine.structured_outputs import StructuredOutputsParams
from draftsmith.serve.openai.cli import (
    build_process_server_app,
    build_server_app,
    free_port,
    server_in_thread,
)
from helpers import DEMO_MODEL, REPO, spec_config

KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EAGLE3 = json.dumps(spec_config("eagle3", REPO / "assets" / "demo-code-7m-eagle3", 4))
KWARGS = {"model": str(DEMO_MODEL), "dtype": "float32", "device": "cpu", "max_num_seqs": 4, "max_model_len": 256,
          "speculative_config": EAGLE3}
CANARY = "import os\n\n\ndef walk(root):\n    for dirpath, dirs, files in os.wa"
CANARY_TOKENS = 96


@pytest.fixture(scope="module")
def canary_text():
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256)
    out = plain.generate(CANARY, SamplingParams(temperature=0, max_tokens=CANARY_TOKENS, ignore_eos=True),
                         use_tqdm=False)[0]
    return out.outputs[0].text


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    """A speculating server (EAGLE-3, every step drafts) with an API key, its engine on a thread or in a
    process of its own."""
    if request.param == "thread":
        app = build_server_app(LLM(**KWARGS), "demo", api_key=KEY)
    else:
        app = build_process_server_app(KWARGS, "demo", api_key=KEY, max_engine_restarts=2)
    with server_in_thread(app) as url:
        yield url, app


def _stream_text(url: str, first_text: threading.Event | None = None, **extra) -> tuple[str, list[dict]]:
    """A greedy canary stream's text and any error events it carried (it must end with [DONE]); `first_text`
    is set once its first text arrives."""
    body = {"model": "demo", "prompt": CANARY, "max_tokens": CANARY_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}
    text, errors, done = [], [], False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                text.append(event["choices"][0]["text"])
                if first_text is not None:
                    first_text.set()
    assert done, "the stream did not end with [DONE]"
    return "".join(text), errors


class Canary:
    """A canary stream on a thread, beside whatever the test sends."""

    def __init__(self, url: str):
        self.result = None
        self.thread = threading.Thread(target=lambda: setattr(self, "result", _stream_text(url)))
        self.thread.start()

    def text(self) -> str:
        self.thread.join(timeout=120)
        text, errors = self.result
        assert not errors, errors
        return text


def _post(url: str, path: str, body, headers=AUTH) -> httpx.Response:
    """POSTs `body` as ASCII JSON, lone surrogates escaped as \\udXXX (as JavaScript clients send them)."""
    return httpx.post(f"{url}{path}", content=json.dumps(body).encode(), timeout=60,
                      headers={**headers, "content-type": "application/json"})


def _completion(**fields) -> dict:
    return {"model": "demo", "prompt": "def add(a, b):", "max_tokens": 8, **fields}


def test_parameters_that_killed_the_engine_are_answered_and_the_canary_is_unchanged(server, canary_text):
    url, app = server
    canary = Canary(url)
    for seed in (2**64, 2**64 - 1, -(2**63) - 1, 18446744073709551616):
        response = _post(url, "/v1/completions", _completion(seed=seed, n=2))
        assert response.status_code == 400 and "seed" in response.json()["error"]["message"]
    edge = _post(url, "/v1/completions", _completion(seed=2**63 - 1, n=2, temperature=1.0))
    assert edge.status_code == 200 and len(edge.json()["choices"]) == 2  # sample 1's seed wraps into int64
    huge_k = _post(url, "/v1/completions", _completion(top_k=2**63, seed=3, temperature=1.0))
    no_k = _post(url, "/v1/completions", _completion(top_k=-1, seed=3, temperature=1.0))
    assert huge_k.status_code == 200 and huge_k.json()["choices"][0]["text"] == no_k.json()["choices"][0]["text"]
    assert _post(url, "/v1/completions", _completion(stop_token_ids=[2**70])).status_code == 400
    assert _post(url, "/v1/completions", _completion(stop=["x"] * 65)).status_code == 400
    assert canary.text() == canary_text
    assert httpx.get(f"{url}/health").status_code == 200 and app.state.engine.healthy


def test_lone_surrogates_are_a_400_wherever_they_are(server):
    url, _ = server
    bad = "\ud800"  # json.dumps escapes it; the server's JSON parser hands back a lone surrogate
    cases = [("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": f"hi {bad}"}]}),
             ("/v1/completions", _completion(model=bad)),
             ("/v1/completions", _completion(prompt=bad)),
             ("/v1/completions", _completion(stop=[bad])),
             ("/v1/completions", _completion(unknown_field={"k": bad})),
             ("/tokenize", {"prompt": bad}),
             ("/tokenize", {"messages": [{"role": "user", "content": bad}]})]
    for path, body in cases:
        response = _post(url, path, body)
        assert response.status_code == 400, (path, body, response.text)
        assert "not valid Unicode" in response.json()["error"]["message"]
    raw = httpx.post(f"{url}/v1/completions", content=b'{"model": "demo", "prompt": "\xff\xfe"}', headers=AUTH)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == 400


def test_bodies_and_texts_too_large_are_refused_unread_and_every_route_but_health_needs_the_key(server, canary_text):
    url, app = server
    canary = Canary(url)
    huge = {"prompt": "x" * (20 * 2**20)}
    assert _post(url, "/tokenize", huge, headers={}).status_code == 401  # no key: refused before the body
    response = _post(url, "/tokenize", huge)
    assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 2**20
        yield b'"}'

    chunked = httpx.post(f"{url}/tokenize", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert chunked.status_code == 413
    limit = app.state.engine.frontend.max_text_bytes
    for path, body in (("/tokenize", {"prompt": "y" * (limit + 1)}),
                       ("/v1/completions", _completion(prompt="y" * (limit + 1))),
                       ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "y" * (limit + 1)}]})):
        response = _post(url, path, body)
        assert response.status_code == 400 and "more than max_model_len" in response.json()["error"]["message"]
    for path in ("/version", "/metrics", "/openapi.json", "/v1/models"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
        assert httpx.get(f"{url}{path}", headers=AUTH).status_code == 200, path
    assert _post(url, "/detokenize", {"tokens": [1]}, headers={}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert canary.text() == canary_text


def test_public_metrics_leaves_only_metrics_and_health_open():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    with server_in_thread(build_server_app(llm, "demo", api_key=KEY, public_metrics=True)) as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/version").status_code == 401


LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # none finishes during the burst


def _submit(engine, params: SamplingParams):
    """Submits the prompt [1, 2, 3], checked as the server's edge checks it."""
    return engine.submit(engine.frontend.check([1, 2, 3], params))


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_max_queue_counts_requests_that_wait_not_those_that_run(kind):
    """max_num_seqs 4, max_queue 8: a burst of 12 on an idle server all queue (4 run, 8 wait); a 13th is
    refused; requests of n samples wait until n slots are free, first come first served."""
    kwargs = {**KWARGS, "speculative_config": None}
    if kind == "thread":
        engine = ThreadEngine(LLM(**kwargs), max_queue=8)
    else:
        from draftsmith.serve.client.engine_process import start_engine_process
        engine = start_engine_process(kwargs, max_queue=8)
    engine.start()

    async def burst():
        held = [_submit(engine, LONG) for _ in range(12)]  # held: outputs dropped unread abort their request
        with pytest.raises(QueueFullError, match="8 waiting"):
            _submit(engine, LONG)
        engine.cancel_all(QueueFullError("the test is over"))
        for n in [1, 1, 1] + [2] * 8:  # three run; the first pair does not fit the free slot, so all pairs wait
            held.append(_submit(engine, dataclasses.replace(LONG, n=n)))
        with pytest.raises(QueueFullError):  # it would fit the free slot, but the engine admits in order
            _submit(engine, LONG)
        engine.cancel_all(QueueFullError("the test is over"))

    try:
        asyncio.run(burst())
        assert engine.num_unfinished() == 0
    finally:
        engine.shutdown(timeout=1)


def test_a_client_that_stops_reading_is_cut_off_and_its_slot_freed():
    llm = LLM(**{**KWARGS, "speculative_config": None})
    engine = ThreadEngine(llm, max_backlog=40)
    engine.start()

    async def unread():
        outputs = _submit(engine, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        deadline = time.monotonic() + 60
        while engine.num_unfinished() and time.monotonic() < deadline:  # nobody reads
            await asyncio.sleep(0.05)
        assert engine.num_unfinished() == 0
        for _ in range(100):  # the abort reaches the loop thread
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)
        assert not llm.engine.has_unfinished_requests() and sorted(llm.engine.free_slots) == [0, 1, 2, 3]
        with pytest.raises(BacklogFull, match="more than 40"):
            await outputs.__anext__()
        reader = _submit(engine, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        last = None
        async for last in reader:  # noqa: B007  a reader that reads is never cut off
            pass
        return last

    try:
        assert len(asyncio.run(unread()).outputs[0].token_ids) == 60
    finally:
        engine.shutdown(timeout=1)


def test_outputs_dropped_unread_abort_their_request():
    """A handler cancelled before it read anything (its outputs never iterated) still frees the slot."""
    llm = LLM(**{**KWARGS, "speculative_config": None})
    engine = ThreadEngine(llm)
    engine.start()

    async def drop():
        _submit(engine, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))  # dropped at once
        for _ in range(200):
            if engine.num_unfinished() == 0 and not llm.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.05)
        return False

    try:
        assert asyncio.run(drop()) and sorted(llm.engine.free_slots) == [0, 1, 2, 3]
        assert llm.engine.stats["num_generated_tokens"] < 200  # aborted, not run to its end
    finally:
        engine.shutdown(timeout=1)


def test_killing_the_engine_process_mid_stream_restarts_it(canary_text):
    app = build_process_server_app(KWARGS, "demo", api_key=KEY, max_engine_restarts=1)
    with server_in_thread(app) as url:
        engine = app.state.engine
        first_pid = engine.process.pid
        events = []

        first_text = threading.Event()

        def stream():
            events.append(_stream_text(url, first_text))

        reader = threading.Thread(target=stream)
        reader.start()
        # mid-stream: killed at its first text, with most of its 96 tokens to come (a fixed wait let the whole
        # stream finish first on a fast machine)
        assert first_text.wait(timeout=60)
        killed_at = time.monotonic()
        os.kill(first_pid, signal.SIGKILL)
        reader.join(timeout=30)
        text, errors = events[0]
        assert errors and "engine process died (exit code -9)" in errors[0]["message"]
        while httpx.get(f"{url}/health").status_code != 200 and time.monotonic() - killed_at < 60:
            time.sleep(0.1)
        recovered_in = time.monotonic() - killed_at
        assert httpx.get(f"{url}/health").status_code == 200 and engine.process.pid != first_pid
        assert recovered_in < 30, recovered_in
        assert _stream_text(url)[0] == canary_text
        metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
        assert 'draftsmith:engine_restarts_total{model_name="demo"} 1.0' in metrics

        os.kill(engine.process.pid, signal.SIGKILL)  # past max_engine_restarts: dead for good, 503
        deadline = time.monotonic() + 30
        while engine.healthy is not False or engine.unavailable_reason().endswith("retry shortly"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        response = _post(url, "/v1/completions", _completion())
        assert response.status_code == 503 and "cannot serve" in response.json()["error"]["message"]


def _serve(port: int, log: Path, *flags: str) -> subprocess.Popen:
    """`draftsmith serve` on the demo model at `port`, its output in `log`, once /health answers 200."""
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "draftsmith", "serve", str(DEMO_MODEL), "--port", str(port),
                                    "--served-model-name", "demo", "--dtype", "float32", "--device", "cpu",
                                    "--max-num-seqs", "2", *flags],
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log, timeout=120)
    except BaseException:
        process.kill()
        raise
    return process


@pytest.mark.slow
def test_serve_exits_non_zero_when_its_engine_dies_past_the_restart_budget(tmp_path):
    import psutil

    log = tmp_path / "serve.log"
    process = _serve(free_port(), log, "--max-model-len", "256", "--max-engine-restarts", "0")
    try:
        engines = psutil.Process(process.pid).children()
        engine = next(p for p in engines if "spawn_main" in " ".join(p.cmdline()))  # not the resource tracker
        engine.kill()
        assert process.wait(timeout=60) == 1
        assert "exiting for a supervisor to restart the server" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_and_done(tmp_path):
    port = free_port()
    process = _serve(port, tmp_path / "serve.log", "--max-model-len", "2048", "--shutdown-timeout", "1",
                     "--no-engine-process")
    try:
        result = {}
        reader = threading.Thread(target=lambda: result.setdefault("r", _stream_text(
            f"http://127.0.0.1:{port}", max_tokens=2000)))  # about 10 s: far past the timeout
        reader.start()
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        reader.join(timeout=30)
        text, errors = result["r"]  # _stream_text asserts the [DONE]
        assert errors and "--shutdown-timeout 1 s" in errors[0]["message"] and errors[0]["code"] == 503
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM it caught
    finally:
        if process.poll() is None:
            process.kill()


def test_penalties_biases_and_a_schema_cross_to_the_engine_and_give_plain_decodings_answer(server):
    """The new request fields survive the engine process's frames: the answer is plain decoding's with them."""
    url, _ = server
    schema = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"],
              "additionalProperties": False}
    fields = {"presence_penalty": 1.0, "logit_bias": {"7": 3.0}, "bad_words": ["root"], "min_tokens": 2,
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    response = _post(url, "/v1/completions", _completion(prompt=CANARY, max_tokens=40, temperature=0, **fields))
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=40, presence_penalty=1.0, logit_bias={7: 3.0}, bad_words=["root"],
                            min_tokens=2, structured_outputs=StructuredOutputsParams(json=schema))
    assert text == plain.generate([CANARY], params, use_tqdm=False)[0].outputs[0].text
    assert set(json.loads(text)) == {"path"}
