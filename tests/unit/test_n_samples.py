"""n > 1 samples of one prompt (SamplingParams.n): one prefill shared by all, each sample exactly what a
request of its own with seed + i gives, with and without speculation, admitted and aborted together."""

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.outputs import OutputCollector
from helpers import DEMO_MODEL, REPO, spec_config

LONG_PROMPT = ("import numpy as np\n\n\ndef normalize(x):\n    mean = x.mean(axis=0)\n    std = x.std(axis=0)\n"
               "    return (x - mean) / std\n\n\ndef clip(x, low, high):\n    return")


def _llm(**extra):
    # a 16-token prefill budget: the prompt is prefilled in several chunks, each handed to the samples
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256,
               max_num_batched_tokens=16, **extra)


@pytest.mark.slow
def test_seeded_samples_share_one_prefill_and_equal_requests_of_their_own():
    llm = _llm()
    prompt_len = len(llm.encode(LONG_PROMPT)[1])
    assert prompt_len > 32
    params = SamplingParams(n=3, seed=7, temperature=0.9, max_tokens=20, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    before = llm.get_metrics()["num_prompt_tokens"]
    (out,) = llm.generate(LONG_PROMPT, params, use_tqdm=False)
    assert llm.get_metrics()["num_prompt_tokens"] - before == prompt_len  # prefilled once, not three times
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    alone = [llm.generate(LONG_PROMPT, SamplingParams(seed=7 + i, temperature=0.9, max_tokens=20, logprobs=2,
                                                      prompt_logprobs=1, ignore_eos=True), use_tqdm=False)[0]
             for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds differ, so do the samples
    for sample, reference in zip(out.outputs, alone):
        assert sample.text == reference.outputs[0].text
        for got, want in zip(sample.logprobs, reference.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 5e-5 for t in got)
    assert len(out.prompt_logprobs) == prompt_len
    assert all(abs(a[t].logprob - b[t].logprob) < 5e-5
               for a, b in zip(out.prompt_logprobs[1:], alone[0].prompt_logprobs[1:]) for t in a)
    assert llm.engine.free_slots == [0, 1, 2, 3] and not llm.engine.groups and not llm.engine.requests


@pytest.mark.slow
def test_samples_hand_the_drafter_the_shared_prompt():
    """Greedy samples with EAGLE-3 at fixed k: each is the plain greedy output, and each drafts exactly as a
    request of its own does (the prompt's features reached every sample's slot), so two samples accept
    twice the drafts of one."""
    spec = spec_config("eagle3", REPO / "assets" / "demo-code-7m-eagle3", 3)
    plain = _llm().generate(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    one, two = _llm(speculative_config=spec), _llm(speculative_config=spec)
    single = one.generate(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    (pair,) = two.generate(LONG_PROMPT, SamplingParams(n=2, temperature=0, max_tokens=24), use_tqdm=False)
    assert [c.token_ids for c in pair.outputs] == [plain.outputs[0].token_ids] * 2 == [single.outputs[0].token_ids] * 2
    accepted_one = one.get_metrics()["num_accepted_tokens"]
    assert accepted_one > 0
    assert two.get_metrics()["num_accepted_tokens"] == 2 * accepted_one


def test_samples_are_admitted_and_aborted_together():
    llm = _llm()
    engine = llm.engine
    ids = llm.encode(LONG_PROMPT)[1]
    first = engine.add_request(ids, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    second = engine.add_request(ids, SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    collector = OutputCollector()
    outputs = collector.add_all(engine.step())
    assert len(engine.running) == 3 and len(engine.free_slots) == 1  # the pair waits for two slots
    assert [r.index for r in engine.running] == [0, 1, 2]
    engine.abort_request(f"{first.request_id}:1")  # one sample's id aborts its whole group
    assert all(m.finish_reason == "abort" for m in first.members)
    while engine.has_unfinished_requests():
        outputs += collector.add_all(engine.step())
    final = {o.request_id: o for o in outputs if o.finished}  # a request's output is one object, updated
    assert list(final) == [second.request_id]
    assert [len(c.token_ids) for c in final[second.request_id].outputs] == [5, 5]
    assert engine.free_slots == [0, 1, 2, 3] and not engine.groups


def test_more_samples_than_slots_is_one_line():
    llm = _llm()
    with pytest.raises(DraftsmithError, match="n=5 samples run at once, one cache slot each, but max_num_seqs is 4"):
        llm.generate("def f():", SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(DraftsmithError, match=r"SamplingParams.n=0 must be an integer >= 1"):
        SamplingParams(n=0)
