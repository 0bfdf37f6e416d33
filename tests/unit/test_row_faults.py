"""One request's fault fails that request alone (`serve.engine.row_faults`): a row that fails in a speculative batch
leaves the other rows' greedy outputs exactly as plain decoding's, the engine goes on, and settings that
cannot be stepped (seeds past int64, a top_k past any tensor) are refused or bounded when a request comes in."""

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine import row_faults
from draftsmith.serve.engine.outputs import OutputCollector
from draftsmith.serve.engine.row_faults import MAX_CONSECUTIVE_FAULTS, EngineFault
from draftsmith.serve.engine.sampling_params import INT64_MAX, INT64_MIN
from helpers import CODE_PROMPTS, DEMO_MODEL, REPO, spec_config

EAGLE3 = json.dumps(spec_config("eagle3", REPO / "assets" / "demo-code-7m-eagle3", 4))  # every step drafts
GREEDY = SamplingParams(temperature=0, max_tokens=32)
BAD = "bad"


@pytest.fixture(scope="module")
def eagle3_llm():
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256, speculative_config=EAGLE3)


def _run(llm, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        llm.engine.add_request(llm.encode(prompt)[1], params, request_id=request_id)
    outputs, collector = {}, OutputCollector()
    while llm.engine.has_unfinished_requests():
        for out in collector.add_all(llm.engine.step()):
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def _fails_for_bad_row(work, rows_of):
    """`work`, raising once the bad request has generated a few tokens and is among the rows it is given."""
    def wrapped(*args, **kwargs):
        if any(r.request_id.split(":")[0] == BAD and len(r.output_token_ids) >= 3 for r in rows_of(args)):
            raise ValueError("injected fault")
        return work(*args, **kwargs)
    return wrapped


def _inject(llm, phase: str, monkeypatch) -> None:
    engine = llm.engine
    if phase == "drafting":
        monkeypatch.setattr(engine.proposer, "propose", _fails_for_bad_row(engine.proposer.propose, lambda a: a[0]))
    elif phase == "stop handling":
        monkeypatch.setattr(engine.stop_checker, "append", _fails_for_bad_row(engine.stop_checker.append,
                                                                              lambda a: [a[0]]))
    else:
        monkeypatch.setattr(row_faults, "token_logprobs", _fails_for_bad_row(row_faults.token_logprobs,
                                                                                lambda a: a[0]))


@pytest.mark.parametrize("phase", ["drafting", "stop handling", "logprobs"])
def test_a_failing_row_fails_alone_and_the_others_equal_plain_decoding(eagle3_llm, greedy_reference, phase,
                                                                      monkeypatch):
    _inject(eagle3_llm, phase, monkeypatch)
    drafts_before = eagle3_llm.get_metrics()["num_drafts"]
    requests = {str(i): (p, GREEDY) for i, p in enumerate(CODE_PROMPTS)}
    requests[BAD] = (CODE_PROMPTS[1], GREEDY)  # five requests, four slots: one waits for a freed slot
    outputs = _run(eagle3_llm, requests)
    assert [outputs[str(i)].outputs[0].token_ids for i in range(len(CODE_PROMPTS))] == greedy_reference
    assert all(outputs[str(i)].error is None for i in range(len(CODE_PROMPTS)))
    bad = outputs[BAD]
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error.startswith(f"{phase} failed for this request") and "injected fault" in bad.error
    assert eagle3_llm.get_metrics()["num_drafts"] > drafts_before  # the batch kept speculating
    assert sorted(eagle3_llm.engine.free_slots) == [0, 1, 2, 3] and not eagle3_llm.engine.requests
    monkeypatch.undo()
    again = eagle3_llm.generate(CODE_PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == greedy_reference[0]


def test_one_failing_sample_fails_its_whole_request(eagle3_llm, monkeypatch):
    _inject(eagle3_llm, "stop handling", monkeypatch)
    eagle3_llm.engine.add_request(eagle3_llm.encode(CODE_PROMPTS[0])[1], SamplingParams(temperature=0, max_tokens=16, n=2),
                                  request_id=BAD)
    outputs, collector = [], OutputCollector()
    while eagle3_llm.engine.has_unfinished_requests():
        outputs += collector.add_all(eagle3_llm.engine.step())
    last = outputs[-1]
    assert last.finished and last.error is not None
    assert [c.finish_reason for c in last.outputs] == ["error", "error"]
    assert not eagle3_llm.engine.groups and not eagle3_llm.engine.running


def test_a_failed_phase_fails_its_rows_not_the_waiting_ones_and_repeated_failures_are_an_engine_fault(monkeypatch):
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=128)
    engine = llm.engine
    calls = {"n": 0}
    forward = engine.step_forward

    def failing_forward(*args):
        calls["n"] += 1
        if calls["n"] == 2:  # the running request's second decode step
            raise RuntimeError("injected forward fault")
        return forward(*args)

    monkeypatch.setattr(engine, "step_forward", failing_forward)
    outputs = _run(llm, {"a": (CODE_PROMPTS[0], GREEDY), "b": (CODE_PROMPTS[2], GREEDY)})
    assert outputs["a"].error.startswith("decode failed for this request")
    assert outputs["b"].error is None and len(outputs["b"].outputs[0].token_ids) == 32  # it waited, then ran

    monkeypatch.setattr(engine, "step_forward", lambda *args: (_ for _ in ()).throw(RuntimeError("broken")))
    failed = 0
    with pytest.raises(EngineFault, match=f"decode failed {MAX_CONSECUTIVE_FAULTS} steps in a row"):
        for _ in range(4 * MAX_CONSECUTIVE_FAULTS):  # each new request prefills, then its decode fails
            if not engine.has_unfinished_requests():
                engine.add_request(llm.encode(CODE_PROMPTS[0])[1], SamplingParams(temperature=0, max_tokens=64))
            failed += sum(out.error is not None for out in engine.step())
    assert failed == MAX_CONSECUTIVE_FAULTS - 1  # the last one's output goes with the fault


def test_seeds_past_int64_are_refused_and_sample_seeds_wrap(demo_llm):
    with pytest.raises(DraftsmithError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(DraftsmithError, match="seed"):
        SamplingParams(seed=INT64_MIN - 1)
    sampled = dict(temperature=1.0, max_tokens=12)
    pair = demo_llm.generate(CODE_PROMPTS[0], SamplingParams(**sampled, seed=INT64_MAX, n=2), use_tqdm=False)[0]
    first = demo_llm.generate(CODE_PROMPTS[0], SamplingParams(**sampled, seed=INT64_MAX), use_tqdm=False)[0]
    wrapped = demo_llm.generate(CODE_PROMPTS[0], SamplingParams(**sampled, seed=INT64_MIN), use_tqdm=False)[0]
    assert pair.outputs[0].token_ids == first.outputs[0].token_ids
    assert pair.outputs[1].token_ids == wrapped.outputs[0].token_ids  # sample 1: seed + 1, wrapped into int64


def test_a_top_k_past_the_vocabulary_is_no_filter(demo_llm):
    sampled = dict(temperature=1.0, max_tokens=12, seed=7)
    huge = demo_llm.generate(CODE_PROMPTS[0], SamplingParams(**sampled, top_k=2**63), use_tqdm=False)[0]
    off = demo_llm.generate(CODE_PROMPTS[0], SamplingParams(**sampled, top_k=-1), use_tqdm=False)[0]
    assert huge.outputs[0].token_ids == off.outputs[0].token_ids


def test_settings_that_cannot_be_stepped_are_refused_when_added(demo_llm, monkeypatch):
    build = row_faults.SamplingBatch.build

    def build_failing_for_odd_temperature(params, *args, **kwargs):
        if any(p.temperature == 0.123 for p in params):
            raise OverflowError("injected")
        return build(params, *args, **kwargs)

    monkeypatch.setattr(row_faults.SamplingBatch, "build", build_failing_for_odd_temperature)
    with pytest.raises(DraftsmithError, match="sampling settings cannot be used.*injected"):
        demo_llm.engine.add_request([1, 2, 3], SamplingParams(temperature=0.123))
    assert not demo_llm.engine.requests and not demo_llm.engine.waiting


def test_after_an_engine_fault_the_engine_serves_again(monkeypatch):
    """The fault count starts again once EngineFault is raised: an engine on a thread (which cannot be
    restarted) fails what was in flight, then serves the next request."""
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=128)
    engine = llm.engine
    monkeypatch.setattr(engine, "step_forward", lambda *args: (_ for _ in ()).throw(RuntimeError("broken")))
    with pytest.raises(EngineFault):
        for _ in range(4 * MAX_CONSECUTIVE_FAULTS):
            if not engine.has_unfinished_requests():
                engine.add_request(llm.encode(CODE_PROMPTS[0])[1], SamplingParams(temperature=0, max_tokens=64))
            engine.step()
    monkeypatch.undo()
    for request in list(engine.running) + list(engine.waiting):
        engine.abort_request(request.request_id)
    again = llm.generate(CODE_PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert again.error is None and len(again.outputs[0].token_ids) == 8


def test_a_sample_whose_text_fails_fails_its_request_whole_and_aborts_survive_a_failing_text(eagle3_llm, monkeypatch):
    finalize = eagle3_llm.engine.stop_checker.finalize_text

    def failing_for_bad(request):
        if request.request_id.startswith(BAD):
            raise ValueError("injected text fault")
        return finalize(request)

    monkeypatch.setattr(eagle3_llm.engine.stop_checker, "finalize_text", failing_for_bad)
    params = SamplingParams(temperature=0, max_tokens=8, n=2)
    eagle3_llm.engine.add_request(eagle3_llm.encode(CODE_PROMPTS[0])[1], params, request_id=BAD)
    outputs, collector = [], OutputCollector()
    while eagle3_llm.engine.has_unfinished_requests():
        outputs += collector.add_all(eagle3_llm.engine.step())
    assert outputs[-1].finished and "detokenizing failed" in outputs[-1].error
    assert not eagle3_llm.engine.running and not eagle3_llm.engine.groups and not eagle3_llm.engine.requests

    eagle3_llm.engine.add_request(eagle3_llm.encode(CODE_PROMPTS[0])[1], SamplingParams(max_tokens=64), request_id=BAD)
    eagle3_llm.engine.step()
    eagle3_llm.engine.abort_request(BAD)  # its text raises: the abort still frees the slot
    assert not eagle3_llm.engine.has_unfinished_requests() and sorted(eagle3_llm.engine.free_slots) == [0, 1, 2, 3]
