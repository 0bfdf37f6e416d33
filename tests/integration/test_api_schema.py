"""The server is what /openapi.json says it is: schemathesis, an independent fuzzer, generates requests from the
schema (valid and invalid ones) against a live demo server and checks every answer with its conformance
checks. Bounded so that it takes well under a minute here."""

from __future__ import annotations

import httpx
import pytest

from draftsmith.serve import LLM
from draftsmith.serve.openai.cli import build_server_app, server_in_thread
from helpers import DEMO_MODEL

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (a [dev] dependency)")
hypothesis = pytest.importorskip("hypothesis")
EXAMPLES = 20  # per operation and generation mode


@pytest.fixture(scope="module")
def server_url():
    # a short context keeps fuzzed max_tokens cheap
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=48,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with server_in_thread(build_server_app(llm, "demo")) as url:
        yield url


def test_schema_documents_what_the_server_answers(server_url):
    schema = httpx.get(f"{server_url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "500", "503"} <= set(responses) and "422" not in responses
        assert "text/event-stream" in responses["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    health = httpx.get(f"{server_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(f"{server_url}/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_nothing(server_url, mode):
    from schemathesis.checks import (
        content_type_conformance,
        negative_data_rejection,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]
    schema = schemathesis.openapi.from_url(f"{server_url}/openapi.json")
    generation = schemathesis.GenerationMode.POSITIVE if mode == "positive" else schemathesis.GenerationMode.NEGATIVE
    failures, ran = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == "negative" and operation.method.upper() == "GET":
            continue  # no parameters to make invalid

        @hypothesis.given(operation.as_strategy(generation_mode=generation))
        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def fuzz(case):
            case.call_and_validate(checks=checks)

        try:
            fuzz()
        except BaseException as exc:  # schemathesis reports failures as exception groups
            failures.append(f"{operation.label}: {str(exc).splitlines()[:8]}")
        ran += 1
    assert ran >= 2 and not failures, "\n".join(failures)
