"""A standing fuzz of `draftsmith serve` (test-only): hypothesis sends boundary values for every field of every
endpoint (int64 and uint64 edges, NaN and infinities, huge and empty lists, invalid Unicode, wrong types,
unknown fields, malformed and deeply nested JSON) to a live server speculating with the shipped EAGLE-3
head, while a canary request streams beside them. It holds when no answer is a 5xx (nor a stream's error
event with a 5xx code), every canary output equals plain decoding's, and the engine process is the one that
started (no deaths, no restarts).

`tests/integration/test_fuzz_server.py` runs a bounded fuzz in `make test`; `make fuzz-serve` runs
`python tests/fuzz_server.py --requests 10000` and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import spec_config  # tests/ is on sys.path: this script's folder, or pytest's pythonpath

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "assets" / "demo-code-7m"
EAGLE3 = spec_config("eagle3", REPO / "assets" / "demo-code-7m-eagle3", 4)
SERVER_KWARGS = {"model": str(DEMO_MODEL), "dtype": "float32", "device": "cpu", "max_num_seqs": 4,
                 "max_model_len": 64, "speculative_config": json.dumps(EAGLE3)}  # a short context bounds the cost
CANARY_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
CANARY_TOKENS = 40

INTS = [0, 1, -1, 2, 20, 21, 64, 65, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1,
        2**64 - 1, 2**64, 10**30, -(10**30)]
FLOATS = [0.0, -0.0, 0.5, 1.0, 2.0, 2.0000001, 1e-320, 1e308, -1e308, math.nan, math.inf, -math.inf]
TEXTS = ["", "a", "def f(x):", "\ud800", "ok \udfff end", "\x00", "é" * 300, "🙂" * 50, "<|im_start|>user",
         "x" * 70000, " " * 5000, "\\u0000"]
ODD = [None, True, False, {}, {"k": "\ud800"}, [], "1", [[[[[]]]]]]

ENDPOINTS = {
    "/v1/completions": {"model": "demo", "prompt": "def add(a, b):", "max_tokens": 6},
    "/v1/chat/completions": {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
    "/tokenize": {"prompt": "def add(a, b):"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
# vLLM's sampling and structured-output fields, on both generation endpoints
SAMPLING = ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens",
            "bad_words", "allowed_token_ids", "truncate_prompt_tokens", "response_format", "structured_outputs",
            "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                        "seed", "n", "ignore_eos", "stream", "stream_options", "best_of", "logprobs", "echo",
                        "unknown_field", *SAMPLING],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                             "top_k", "stop", "stop_token_ids", "seed", "n", "ignore_eos", "stream",
                             "stream_options", "logprobs", "top_logprobs", "unknown_field", *SAMPLING, "tools",
                             "tool_choice", "parallel_tool_calls"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "unknown_field"],
    "/detokenize": ["model", "tokens", "unknown_field"],
}
# values at the edges of what each field accepts, so that fuzzed requests also reach the engine
EDGES = {
    "max_tokens": [1, 63, 64, 2**63 - 1, 10**30], "max_completion_tokens": [1, 64, 2**63], "temperature": [0.0, 2.0, 1e-9],
    "top_p": [1e-9, 1.0, 0.5], "top_k": [-1, 0, 1, 8191, 8192, 2**63 - 1, 2**63, 10**30],
    "seed": [-(2**63), 2**63 - 1, 0, -1], "n": [1, 2, 4], "logprobs": [0, 20, True], "top_logprobs": [0, 20],
    "stop": ["\n", [""], ["x"] * 64, ["y" * 1024], ["\n", "return"]], "stop_token_ids": [[0], [8191], list(range(1024))],
    "echo": [True], "stream": [True], "stream_options": [{"include_usage": True}], "ignore_eos": [True],
    "prompt": [[0], [8191] * 10, [[1, 2], [3]], ["a", "b"], "x" * 300], "tokens": [[0], list(range(64))],
    "add_special_tokens": [False], "best_of": [1, 2], "model": ["demo", "other"],
    "presence_penalty": [-2.0, 2.0, 2.1], "frequency_penalty": [-2.0, 2.0], "repetition_penalty": [1e-9, 1.5, 100.0, 101.0],
    "min_p": [0.0, 1.0, 0.99], "logit_bias": [{"0": 100}, {"8191": -100}, {"8192": 1}, {"x": 1}, {str(i): 1 for i in range(1025)}],
    "min_tokens": [1, 6, 7, 2**63], "bad_words": [["a"], [""], ["\ud800"], ["x" * 1024] * 64],
    "allowed_token_ids": [[0], [8191], [8192], list(range(8192))], "truncate_prompt_tokens": [-1, 1, 2**63 - 1],
    "response_format": [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                        {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}, {"type": "xml"}],
    "structured_outputs": [{"regex": "[a-z]+"}, {"regex": "("}, {"choice": ["a", "b"]}, {"choice": []},
                           {"grammar": 'start: "a"+'}, {"json": SCHEMA, "regex": "a"}, {"json_object": True}],
    "guided_json": [SCHEMA, "{", {"type": "array", "items": SCHEMA}], "guided_regex": ["\\d{3}", "(" * 1000],
    "guided_choice": [["x"], [""]], "guided_grammar": ["start: /[0-9]+/", "root ::= [a-z]+", "start: ("],
    "tools": [[TOOL], [TOOL] * 129, [{"type": "function", "function": {"name": ""}}]],
    "tool_choice": ["none", "auto", "required", {"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "g"}}],
    "parallel_tool_calls": [False, True],
}


def _field_value(name: str) -> st.SearchStrategy:
    return st.sampled_from(EDGES[name]) | _values() if name in EDGES else _values()


def _values() -> st.SearchStrategy:
    scalar = st.sampled_from(INTS) | st.sampled_from(FLOATS) | st.sampled_from(TEXTS) | st.sampled_from(ODD)
    token_lists = st.sampled_from([[0] * 100000, [2**63] * 3, [-1], [8191, 8192], [2**64], list(range(64))])
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot", ""]),
                                               "content": st.sampled_from(TEXTS) | st.sampled_from(ODD)}),
                        max_size=3) | st.just([{"role": "user", "content": "x"}] * 3000)
    return scalar | token_lists | messages | st.lists(scalar, max_size=70)


@st.composite
def requests(draw) -> tuple[str, str, bytes]:
    """(method, path, body) for one request: a valid base body with 1-4 fields set to boundary values, or
    now and then a body that is not what any endpoint reads."""
    kind = draw(st.sampled_from(["fields"] * 8 + ["raw", "get"]))
    if kind == "get":
        return "GET", draw(st.sampled_from(["/health", "/metrics", "/v1/models", "/version", "/openapi.json"])), b""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    if kind == "raw":
        raw = draw(st.sampled_from([b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe\xfd", b'{"model": "demo"',
                                    b"[" * 100000 + b"]" * 100000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
                                    b'{"prompt": NaN}', json.dumps({"prompt": "\ud800"}).encode()]))
        return "POST", path, raw
    body = dict(ENDPOINTS[path])
    for name in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=4, unique=True)):
        body[name] = draw(_field_value(name))
    return "POST", path, json.dumps(body).encode()  # allow_nan: NaN and Infinity as Python's JSON writes them


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # 5xx answers and 5xx stream error events
    canary_runs: int = 0
    canary_changes: list[str] = field(default_factory=list)

    def record(self, method: str, path: str, body: bytes, response: httpx.Response, stream_errors: list[dict]):
        self.statuses[response.status_code] += 1
        bad = [e for e in stream_errors if e.get("code", 500) >= 500]
        if response.status_code >= 500 or bad:
            self.server_errors.append(f"{method} {path} {body[:300]!r} -> {response.status_code} "
                                      f"{response.text[:300] if not bad else bad}")


def send(client: httpx.Client, method: str, path: str, body: bytes) -> tuple[httpx.Response, list[dict]]:
    """Sends one request; a streamed answer is read to its end, its error events returned."""
    headers = {"content-type": "application/json"}
    with client.stream(method, path, content=body if method == "POST" else None, headers=headers) as response:
        errors = []
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            for line in response.iter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    errors.append(json.loads(line[6:])["error"])
        else:
            response.read()
    return response, errors


def canary_text(client: httpx.Client) -> str:
    body = {"model": "demo", "prompt": CANARY_PROMPT, "max_tokens": CANARY_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    pieces = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                pieces.append(event["choices"][0]["text"] if "choices" in event else f"<error {event}>")
    return "".join(pieces)


def plain_canary() -> str:
    from draftsmith.serve import LLM, SamplingParams

    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=CANARY_TOKENS, ignore_eos=True)
    return llm.generate(CANARY_PROMPT, params, use_tqdm=False)[0].outputs[0].text


def run_fuzz(url: str, examples: int, expected_canary: str, seed: int = 0) -> Tally:
    """`examples` fuzzed requests against `url` while a canary streams on a thread, again and again."""
    tally, done = Tally(), threading.Event()

    def canary_loop():
        with httpx.Client(base_url=url, timeout=120) as client:
            while not done.is_set():
                text = canary_text(client)
                tally.canary_runs += 1
                if text != expected_canary:
                    tally.canary_changes.append(text)

    canary = threading.Thread(target=canary_loop, daemon=True)
    canary.start()
    with httpx.Client(base_url=url, timeout=120) as client:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=seed == 0,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def one(request):
            method, path, body = request
            tally.record(method, path, body, *send(client, method, path, body))

        try:
            one()
        finally:
            done.set()
            canary.join(timeout=180)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fuzz a live `draftsmith serve` (engine process, EAGLE-3) "
                                     "while a canary streams; print the figures.")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0, help="0: hypothesis' derandomized run")
    args = parser.parse_args(argv)
    from draftsmith.serve.openai.cli import build_process_server_app, server_in_thread

    expected = plain_canary()
    app = build_process_server_app(SERVER_KWARGS, "demo")
    started = time.monotonic()
    with server_in_thread(app) as url:
        engine = app.state.engine
        pid = engine.process.pid
        tally = run_fuzz(url, args.requests, expected, args.seed)
        alive = engine.healthy and engine.process.pid == pid and httpx.get(f"{url}/health").status_code == 200
    report = {"requests": sum(tally.statuses.values()), "statuses": dict(sorted(tally.statuses.items())),
              "5xx": len(tally.server_errors), "canary_runs": tally.canary_runs,
              "canary_changes": len(tally.canary_changes), "engine_restarts": len(engine.restarted_at),
              "engine_alive_and_same_process": alive, "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(report, indent=1))
    for line in tally.server_errors[:20]:
        print("5xx:", line, file=sys.stderr)
    ok = not tally.server_errors and not tally.canary_changes and alive and tally.canary_runs > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
