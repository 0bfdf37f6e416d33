"""The engine in its own process (`draftsmith serve`'s default): the same answers as the engine on a thread,
JSON frames only on the pipe, and an engine that dies fails its requests within seconds and turns /health
503 instead of hanging."""

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.openai.cli import build_process_server_app, server_in_thread
from helpers import DEMO_MODEL, REPO, spec_config

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
KWARGS = {"model": str(DEMO_MODEL), "dtype": "float32", "device": "cpu", "max_num_seqs": 4, "max_model_len": 256,
          "speculative_config": SPEC}
PROMPT = "import os\n\n\ndef walk(root):\n    for dirpath, dirs, files in os.wa"


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_answers_and_logprobs_with_eagle3_equal_plain_decoding_with_samples_and_streams():
    """Through the openai client, an engine process speculating with the shipped EAGLE-3 head (every step
    drafts) answers what a plain engine does, logprobs included."""
    reference = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256)
    want = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, logprobs=2), use_tqdm=False)[0]
    eagle3 = json.dumps(spec_config("eagle3", REPO / "assets" / "demo-code-7m-eagle3", 4))
    app = build_process_server_app({**KWARGS, "speculative_config": eagle3}, "demo")
    with server_in_thread(app) as url:
        engine = app.state.engine
        assert engine.process.is_alive() and engine.process.pid != os.getpid()
        client = _client(url)
        got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=2, n=2)
        assert [c.text for c in got.choices] == [want.outputs[0].text] * 2
        entries = want.outputs[0].logprobs
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            [next(iter(e.values())).logprob for e in entries], abs=5e-5)  # fp32: GEMMs of other row counts
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stream=True) if c.choices)
        assert streamed == want.outputs[0].text
        messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
        chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        bad = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "x", "n": 9})
        assert bad.status_code == 400 and "max_num_seqs is 4" in bad.json()["error"]["message"]
        for _ in range(4):  # streams left after their first chunk: the engine aborts them and frees their slots
            with client.completions.create(model="demo", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}) as left:
                next(iter(left))
        deadline = time.monotonic() + 30
        while engine.num_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_unfinished() == 0
        time.sleep(0.6)  # the engine's idle report
        metrics = httpx.get(f"{url}/metrics").text
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("draftsmith:spec_decode_num_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0  # it really speculated
        assert 'draftsmith:num_requests_running{model_name="demo"} 0.0' in metrics
        assert client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text \
            == want.outputs[0].text
    assert not engine.process.is_alive()  # the server's shutdown stopped it


def test_killing_the_engine_fails_requests_in_flight_and_turns_health_503():
    """With no restarts left (the restart itself: test_server_reliability), a dead engine stays dead: 503."""
    app = build_process_server_app(KWARGS, "demo", max_engine_restarts=0)
    with server_in_thread(app) as url:
        engine, client = app.state.engine, _client(url)
        assert httpx.get(f"{url}/health").status_code == 200
        events, errors = [], []

        def stream():
            try:
                for chunk in client.completions.create(model="demo", prompt=PROMPT, max_tokens=240, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True}):
                    events.append(chunk)
            except openai.APIError as exc:
                errors.append(exc)

        def whole():
            try:
                client.completions.create(model="demo", prompt=PROMPT, max_tokens=240, temperature=0,
                                          extra_body={"ignore_eos": True})
            except openai.APIError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(events) >= 3  # mid-stream
        killed_at = time.monotonic()
        os.kill(engine.process.pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads) and time.monotonic() - killed_at < 10
        assert len(errors) == 2 and all("engine process died (exit code -9)" in str(e) for e in errors)
        assert any(isinstance(e, openai.InternalServerError) and e.status_code == 500 for e in errors)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        after = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2})
        assert after.status_code == 503 and "engine process died" in after.json()["error"]["message"]
        assert "cannot serve" in after.json()["error"]["message"]


def test_an_engine_that_cannot_load_is_one_line():
    with pytest.raises(DraftsmithError, match="method 'eagle' needs \"model\""):
        build_process_server_app({**KWARGS, "speculative_config": '{"method": "eagle", "num_speculative_tokens": 2}'},
                                 "demo")
