"""The engine reports deltas: each step, only what a request gained since its last report; its first report
names it whole. Merged in order (`OutputCollector`), they are the request's state at the end."""

from __future__ import annotations

from draftsmith.serve.engine.outputs import OutputCollector
from draftsmith.serve.engine.sampling_params import SamplingParams
from helpers import CODE_PROMPTS


def _run(engine) -> list:
    """Steps until done -> every step's deltas."""
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    return deltas


def test_deltas_carry_each_token_once_and_merge_into_the_final_state(demo_llm):
    engine = demo_llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    ids = demo_llm.encode(CODE_PROMPTS[0])[1]
    one = engine.add_request(ids, params, prompt=CODE_PROMPTS[0])
    group = engine.add_request(demo_llm.encode(CODE_PROMPTS[2])[1], SamplingParams(n=2, max_tokens=6, seed=3))
    deltas = _run(engine)
    mine = [d for d in deltas if d.request_id == one.request_id]
    assert mine[0].header is not None and all(d.header is None for d in mine[1:])  # named once
    assert mine[0].header.prompt_token_ids == ids and mine[0].header.prompt == CODE_PROMPTS[0]
    assert len(mine[0].header.prompt_logprobs) == len(ids)
    new_tokens = [t for d in mine for t in d.samples[0].token_ids]
    assert new_tokens == one.output_token_ids  # every token exactly once, in order
    assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True]
    assert all(d.samples[0].text is None for d in mine[:-1]) and mine[-1].samples[0].text == one.text

    collector = OutputCollector()
    outputs = {o.request_id: o for o in collector.add_all(deltas) if o.finished}
    merged = outputs[one.request_id].outputs[0]
    assert merged.token_ids == one.output_token_ids and merged.logprobs == one.logprobs
    assert merged.text == one.text and merged.finish_reason == "length"
    assert outputs[one.request_id].prompt_logprobs == one.prompt_logprobs
    samples = outputs[group.request_id].outputs
    assert [s.token_ids for s in samples] == [m.output_token_ids for m in group.members]
    assert all(len(s.token_ids) == 6 for s in samples)


def test_a_collector_refuses_a_request_it_never_saw_begin(demo_llm):
    engine = demo_llm.engine
    engine.add_request(demo_llm.encode(CODE_PROMPTS[1])[1], SamplingParams(temperature=0, max_tokens=4))
    first = engine.step()
    later = []
    while engine.has_unfinished_requests():
        later += engine.step()
    assert first and later
    try:
        OutputCollector().add_all(later)
    except ValueError as exc:
        assert "first report has no header" in str(exc)
    else:
        raise AssertionError("a collector merged deltas without their request's first report")
