"""Engine behaviour on the real demo model: batching equals one-by-one, stops, limits, continuous joins."""

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.outputs import OutputCollector
from helpers import DEMO_MODEL, spec_config

PROMPTS = [
    "def add(a, b):\n    return a",
    "import numpy as np\n\n\ndef normalize(x):\n    mean = x.mean(axis=0)\n    std = x.st",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n        self.children = chi",
    "for i in ra",
    "def parse_args():\n    parser = argparse.ArgumentParser(description='Train a model')\n    parser.add_argument('--lr', type=float, default=0.0",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_mixed_lengths_equal_one_by_one(demo_llm):
    alone = [demo_llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    together = demo_llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # 5 prompts, 4 slots: one joins later
    assert _ids(together) == _ids(alone)
    assert [o.outputs[0].text for o in together] == [o.outputs[0].text for o in alone]
    assert all(len(ids) > 0 for ids in _ids(together))


def test_requests_join_as_others_finish():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256,
              max_num_batched_tokens=16)  # small budget: prompts are prefilled in several chunks
    lengths = [3, 30, 5, 25, 8]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    for prompt, p in zip(PROMPTS, params):
        llm.engine.add_request(llm.encode(prompt)[1], p)
    finished_order, running_sets, collector = [], [], OutputCollector()
    while llm.engine.has_unfinished_requests():
        for out in collector.add_all(llm.engine.step()):
            if out.finished:
                finished_order.append(int(out.request_id))
                assert len(out.outputs[0].token_ids) == lengths[int(out.request_id)]
                assert out.outputs[0].finish_reason == "length"
        running_sets.append({r.request_id for r in llm.engine.running})
    assert finished_order[0] == 0 and set(finished_order) == set(range(5))
    assert max(len(s) for s in running_sets) == 2
    assert any({"1", "2"} <= s for s in running_sets)  # request 2 ran beside still-running request 1
    assert llm.engine.free_slots == [0, 1]
    chunked = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256)
    reference = [chunked.generate(pr, p, use_tqdm=False)[0] for pr, p in zip(PROMPTS, params)]
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(again) == _ids(reference)


def test_seeded_sampling_is_batch_independent(demo_llm):
    params = [SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=s, max_tokens=24) for s in range(len(PROMPTS))]
    together = demo_llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [demo_llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
    assert _ids(together) == _ids(alone)
    other_seed = demo_llm.generate(PROMPTS[2], SamplingParams(temperature=0.8, seed=99, max_tokens=24), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != together[2].outputs[0].token_ids


def test_stop_string_and_stop_token(demo_llm):
    free = demo_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    assert "\n" in free.text
    stopped = demo_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop=["\n"]),
                                use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "\n"
    assert stopped.text == free.text.split("\n")[0]
    token = free.token_ids[3]
    by_token = demo_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[token]),
                                 use_tqdm=False)[0].outputs[0]
    assert by_token.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    assert by_token.finish_reason == "stop"


def test_length_limits(demo_llm):
    out = demo_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    small = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=20)
    prompt_ids = small.encode(PROMPTS[0])[1]
    out = small.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(prompt_ids) + len(out.token_ids) == 20 and out.finish_reason == "length"


def test_bad_prompts_are_rejected_before_anything_runs(demo_llm):
    with pytest.raises(DraftsmithError, match="prompt 1: prompt has .* tokens but max_model_len is 512"):
        demo_llm.generate(["ok", "x = 1\n" * 400], GREEDY, use_tqdm=False)
    assert not demo_llm.engine.has_unfinished_requests()
    with pytest.raises(DraftsmithError, match="empty"):
        demo_llm.generate([""], GREEDY, use_tqdm=False)


def test_abort_frees_the_slot(demo_llm):
    engine = demo_llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, stop=["zzz"])  # stop strings keep a decoder per request
    request = engine.add_request(demo_llm.encode(PROMPTS[0])[1], params)
    engine.step()
    engine.step()
    assert request.slot not in engine.free_slots and request.request_id in engine.stop_checker._decoders
    engine.abort_request(request.request_id)
    assert request.finish_reason == "abort" and not engine.has_unfinished_requests()
    assert request.request_id not in engine.stop_checker._decoders
    assert sorted(engine.free_slots) == list(range(engine.config.max_num_seqs))


def test_llms_can_share_one_loaded_target(demo_llm):
    """target=: a second LLM (here with speculation) serves from the first one's weights, each with its own
    cache; what it generates is what it would with its own copy."""
    shared = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256, target=demo_llm.model,
                 speculative_config=spec_config("ngram", k=3))
    assert shared.model is demo_llm.model and shared.engine.cache is not demo_llm.engine.cache
    prompts = ["def add(a, b):\n    return a", "x = 1\ny = 2\nx = 1\ny ="]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    got = shared.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in demo_llm.generate(prompts, greedy, use_tqdm=False)]
    with pytest.raises(DraftsmithError, match="target= is on cpu"):
        LLM(DEMO_MODEL, device="meta", target=demo_llm.model)


def test_without_a_tokenizer_prompts_are_ids_and_outputs_have_no_text(demo_llm):
    bare = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256, skip_tokenizer_init=True,
               target=demo_llm.model)
    ids = demo_llm.encode(PROMPTS[0])[1]
    got = bare.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0]
    want = demo_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == ""
    with pytest.raises(DraftsmithError, match="text prompts need a tokenizer"):
        bare.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    with pytest.raises(DraftsmithError, match="stop strings need a tokenizer"):
        bare.generate({"prompt_token_ids": ids}, SamplingParams(stop=["\n"]), use_tqdm=False)
