"""lm-evaluation-harness, run as its users run it against a server (`local-completions`), on two local tasks
(tests/lm_eval_tasks: a loglikelihood multiple-choice task and a generation task), against `draftsmith serve`
with n-gram speculation, and compared doc by doc with lm-eval's own transformers backend (`hf`) on the same
demo model: an implementation of loglikelihood and greedy generation that shares no code with ours."""

from __future__ import annotations

import pytest

from draftsmith.serve import LLM
from draftsmith.serve.openai.cli import build_server_app, server_in_thread
from helpers import DEMO_MODEL, REPO, make_speculation_pay

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]'; `make test` "
                              "installs it with the test oracles)")
TASKS_DIR = REPO / "tests" / "lm_eval_tasks"
TASKS = ["draftsmith_code_choice", "draftsmith_code_continue"]


def _evaluate(model: str, model_args: str) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, log_samples=True,
                                   task_manager=TaskManager(include_path=str(TASKS_DIR)))


def test_lm_eval_loglikelihood_and_generation_tasks_match_its_transformers_backend(monkeypatch):
    monkeypatch.chdir(TASKS_DIR)  # the task YAMLs name their data files relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reference = _evaluate("hf", f"pretrained={DEMO_MODEL},dtype=float32,device=cpu")
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=512, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    make_speculation_pay(llm)  # drafts happen whatever this machine's speed
    with server_in_thread(build_server_app(llm, "demo")) as url:
        served = _evaluate("local-completions", f"model=demo,base_url={url}/v1/completions,tokenizer_backend="
                           f"huggingface,tokenizer={DEMO_MODEL},num_concurrent=2,max_retries=1")
    assert llm.get_metrics()["num_accepted_tokens"] > 0  # the generation task ran speculatively
    choice, continuation = (served["results"][t] for t in TASKS)
    assert choice["acc,none"] == reference["results"][TASKS[0]]["acc,none"] >= 0.5
    assert len(served["samples"][TASKS[0]]) == len(reference["samples"][TASKS[0]]) == 6
    for ours, theirs in zip(served["samples"][TASKS[0]], reference["samples"][TASKS[0]]):
        # per choice: (sum of the continuation's logprobs, whether every token was the argmax)
        for (ll, greedy), (ll_ref, greedy_ref) in zip(ours["filtered_resps"], theirs["filtered_resps"]):
            assert ll == pytest.approx(ll_ref, abs=1e-3) and greedy == greedy_ref
    assert continuation["exact_match,first_token_span"] == reference["results"][TASKS[1]]["exact_match,first_token_span"]
    assert [s["filtered_resps"] for s in served["samples"][TASKS[1]]] == \
        [s["filtered_resps"] for s in reference["samples"][TASKS[1]]]
