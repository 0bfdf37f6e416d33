"""Logprobs of generated tokens: the target's own distribution at each position, the same with and without
speculation (accepted drafts take theirs from the verify forward), truncated with the tokens at a stop."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM, SamplingParams
from helpers import DEMO_MODEL, REPO, spec_config

PROMPTS = [
    "def add(a, b):\n    return a",
    "x = 1\ny = 2\nz = 3\nx = 1\ny = ",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n        self.children = chi",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    "import os\nimport sys\nimport os\nimport ",
]
TOP = 3
# fp32 matmuls on CPU round differently with the number of rows they multiply (the demo target's LM head alone:
# 5.7e-6 between 10 rows at once and one at a time), so a verify forward's logits differ from a decode's by up
# to 1.7e-5 at logits of magnitude 18: logprobs agree to that, not bit for bit
SAME = 5e-5
GREEDY = SamplingParams(temperature=0, max_tokens=40, logprobs=TOP)
SPECULATION = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "eagle3": {"method": "eagle3", "model": str(REPO / "assets" / "demo-code-7m-eagle3"), "num_speculative_tokens": 4},
}


def _llm(speculation: dict | None = None, **kwargs) -> LLM:
    # fixed k: every step that can draft does, so accepted drafts' logprobs really come from verify forwards
    config = None if speculation is None else spec_config(**speculation)
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
               speculative_config=config, **kwargs)


@pytest.fixture(scope="module")
def plain_outputs():
    return [o.outputs[0] for o in _llm().generate(PROMPTS, GREEDY, use_tqdm=False)]


def _assert_same_logprobs(got, want):
    assert got.token_ids == want.token_ids
    assert len(got.logprobs) == len(got.token_ids) == len(want.logprobs)
    for token, mine, theirs in zip(got.token_ids, got.logprobs, want.logprobs):
        assert next(iter(mine)) == token  # the generated token first
        assert list(mine) == list(theirs)  # same alternatives, in rank order
        for token_id in mine:
            assert mine[token_id].rank == theirs[token_id].rank
            assert mine[token_id].logprob == pytest.approx(theirs[token_id].logprob, abs=SAME)


@pytest.mark.slow
def test_logprobs_are_the_targets_log_softmax_at_each_position(plain_outputs):
    """Checked against transformers' own Llama over prompt + output, not against our forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    for prompt, output in zip(PROMPTS, plain_outputs):
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + output.token_ids])).logits[0]
        reference = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)  # the distribution each token came from
        for position, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
            assert entry[token].logprob == pytest.approx(reference[position, token].item(), abs=1e-4)
            assert entry[token].rank == 1  # greedy: the argmax
            top = reference[position].topk(TOP)
            assert set(entry) == {token, *top.indices.tolist()}
            for value, token_id in zip(top.values.tolist(), top.indices.tolist()):
                assert entry[token_id].logprob == pytest.approx(value, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(SPECULATION))
def test_logprobs_are_the_same_with_speculation(method, plain_outputs):
    llm = _llm(SPECULATION[method])
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]  # 5 prompts, 3 slots
    assert llm.get_metrics()["num_accepted_tokens"] > 0  # drafts were accepted: their logprobs came from verify
    for got, want in zip(outputs, plain_outputs):
        _assert_same_logprobs(got, want)


@pytest.mark.slow
def test_logprobs_stop_with_the_tokens_at_a_stop_string_inside_a_verified_run():
    """A stop string met mid-way through a step's accepted drafts drops the tokens after it, and their
    logprobs with them."""
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0, stop=["range"])
    plain = _llm().generate(PROMPTS[3:], params, use_tqdm=False)[0].outputs[0]
    spec = _llm(SPECULATION["ngram"]).generate(PROMPTS[3:], params, use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == spec.finish_reason == "stop"
    _assert_same_logprobs(spec, plain)
    assert all(len(entry) == 1 for entry in spec.logprobs)  # logprobs=0: the token's own, no alternatives


@pytest.mark.slow
def test_processed_logprobs_are_of_the_filtered_distribution():
    """processed_logprobs: after temperature and top-k, so the top-k tokens' probabilities sum to 1 and the
    sampled token is among them; raw ones are the model's and sum to less."""
    params = SamplingParams(temperature=0.7, top_k=2, max_tokens=12, seed=3, logprobs=2)
    for mode, total in (("processed_logprobs", 1.0), ("raw_logprobs", None)):
        output = _llm(logprobs_mode=mode).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        for token, entry in zip(output.token_ids, output.logprobs):
            assert entry[token].rank <= 2
            mass = sum(torch.tensor([e.logprob for e in entry.values()]).exp().tolist())
            if total is None:
                assert mass < 1.0
            else:
                assert mass == pytest.approx(total, abs=1e-5)


@pytest.mark.slow
def test_no_logprobs_unless_asked_and_bad_values_are_refused():
    output = _llm().generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert output.outputs[0].logprobs is None
    with pytest.raises(DraftsmithError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(DraftsmithError, match="logprobs_mode"):
        _llm(logprobs_mode="logits")


@pytest.mark.slow
def test_prompt_logprobs_score_each_prompt_token_given_the_ones_before_it_chunked_or_not():
    """prompt_logprobs, checked against transformers' Llama; a prompt read in chunks of 7 tokens (and beside
    another prompt) scores the same as one read whole."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    whole = _llm().generate(PROMPTS[2:4], params, use_tqdm=False)
    chunked = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256,
                  max_num_batched_tokens=7).generate(PROMPTS[2:4], params, use_tqdm=False)
    for output, other in zip(whole, chunked):
        ids = output.prompt_token_ids
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(ids)
        with torch.inference_mode():
            reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], dim=-1)
        for position, (token, entry, again) in enumerate(zip(ids[1:], output.prompt_logprobs[1:],
                                                             other.prompt_logprobs[1:])):
            assert next(iter(entry)) == token
            assert entry[token].logprob == pytest.approx(reference[position, token].item(), abs=1e-4)
            value = reference[position, token]  # the rank, up to tokens within rounding of this one
            above, near = int((reference[position] > value + 1e-4).sum()), int((reference[position] > value - 1e-4).sum())
            assert above + 1 <= entry[token].rank <= near + 1
            assert set(entry) == {token, *reference[position].topk(2).indices.tolist()}
            assert list(again) == list(entry)
            assert again[token].logprob == pytest.approx(entry[token].logprob, abs=SAME)
        assert output.outputs[0].token_ids == other.outputs[0].token_ids
