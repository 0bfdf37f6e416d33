"""A request is checked once, where it enters (`engine/checks.py`): the server's edge for a served request,
`LLM.generate` for an offline one; the engine then takes the proof (`CheckedRequest`) without checking
again."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.checks import RequestLimits
from draftsmith.serve.openai.cli import build_server_app
from helpers import CODE_PROMPTS, DEMO_MODEL


@pytest.fixture
def checks(monkeypatch) -> list:
    """Every prompt `RequestLimits.check` is asked to check."""
    seen, check = [], RequestLimits.check

    def counting(self, prompt_token_ids, params, prompt=None):
        seen.append(list(prompt_token_ids))
        return check(self, prompt_token_ids, params, prompt)

    monkeypatch.setattr(RequestLimits, "check", counting)
    return seen


def test_generate_checks_each_prompt_once(demo_llm, checks):
    outputs = demo_llm.generate(CODE_PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(checks) == 3 and all(len(o.outputs[0].token_ids) == 4 for o in outputs)


@pytest.mark.slow
def test_the_server_checks_each_prompt_once_at_its_edge(checks):
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=128)
    with TestClient(build_server_app(llm, "demo")) as client:
        body = {"model": "demo", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 2
        assert checks == [[1, 2, 3], [4, 5]]
        refused = client.post("/v1/completions", json={**body, "prompt": [[1, 2], [10**6]]})
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("prompt 1: ")
        chat = client.post("/v1/chat/completions", json={"model": "demo", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and len(checks) == 5  # the chat prompt: once
