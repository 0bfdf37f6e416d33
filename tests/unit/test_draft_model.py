"""Draft models (`method: draft_model`): lossless decoding with drafts from a model of the target's own
tokenizer, its cache kept in step with what is accepted, and one-line errors for what cannot work."""

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM, SamplingParams
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    flattened_demo_copy,
    make_speculation_pay,
    make_tiny_checkpoint,
    make_tiny_target_with_tokenizer,
    spec_config,
)


def _serve(draft_dir, k=4, max_num_seqs=3, **keys):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=max_num_seqs, max_model_len=256,
               speculative_config=spec_config("draft_model", draft_dir, k, **keys))


def test_the_target_drafting_for_itself_is_accepted_almost_always(greedy_reference):
    """The demo model as its own draft (in bfloat16): every row's cache follows accepted drafts, rejected
    ones and rows joining and leaving (4 prompts, 3 slots), or acceptance would fall."""
    llm = _serve(DEMO_MODEL)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    metrics = llm.get_metrics()
    assert metrics["num_accepted_tokens"] >= 0.9 * metrics["num_draft_tokens"] > 0


def test_a_new_rows_prompt_is_fed_at_its_first_draft_and_priced_by_the_draft_models_table():
    """The policy is told which rows the draft model has not been fed yet (their prompt is the catch-up, spread
    over the request's steps), and prices catch-ups by the draft model's own forward table, profiled at
    prompt lengths."""
    llm = _serve(DEMO_MODEL, max_num_seqs=1, adaptive=True)
    make_speculation_pay(llm)
    engine = llm.engine
    table = engine.policy.cost.catch_up_table
    assert table is not None and max(table.query_lens) >= 512 and table.context == 0
    engine.add_request(llm.encode("def fibonacci(n):")[1], SamplingParams(temperature=0, max_tokens=16))
    engine.step()  # the prompt's prefill
    assert engine.proposer.unfed_rows(engine.running) == [0] and engine.proposer.catch_up(engine.running)[0] == 1
    engine.step()  # a draft, which feeds the prompt first
    assert llm.get_metrics()["num_drafts"] > 0
    assert engine.proposer.unfed_rows(engine.running) == []


def test_a_random_draft_model_decodes_with_greedy_equality(tmp_path, greedy_reference):
    draft = make_tiny_target_with_tokenizer(tmp_path / "draft")  # the demo tokenizer, random weights
    llm = _serve(draft, k=3)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_adaptive_k_keeps_greedy_equality(greedy_reference):
    from helpers import make_speculation_pay

    llm = _serve(DEMO_MODEL, adaptive=True)
    make_speculation_pay(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.slow
def test_seeded_sampled_drafts_repeat_alone_and_batched(tmp_path):
    """Drafts sampled from a draft that disagrees with the target, rows reaching their limits at different
    steps: a seeded request draws only for the drafts it keeps, so it samples the same text alone and in a
    batch (fixed k)."""
    draft = flattened_demo_copy(tmp_path)
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
              speculative_config=spec_config("draft_model", draft, 3, draft_sample_method="probabilistic"))
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=n) for s, n in enumerate((17, 22, 26))]
    batched = [o.outputs[0].token_ids for o in llm.generate(CODE_PROMPTS[:3], params, use_tqdm=False)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(CODE_PROMPTS, params)]
    assert batched == alone
    metrics = llm.get_metrics()
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]  # draws both kept and rejected


def test_rows_at_the_end_of_the_context_draft_no_further(greedy_reference):
    """A row whose context is nearly full drafts fewer tokens than the rows beside it, and feeds the draft
    model no position past its cache (max_model_len 48: the long prompt runs into it)."""
    kwargs = dict(dtype="float32", device="cpu", max_num_seqs=3, max_model_len=48)
    plain = LLM(DEMO_MODEL, **kwargs)
    long = {"prompt_token_ids": plain.encode(CODE_PROMPTS[1] * 3)[1][:36]}  # 12 tokens of room
    prompts, params = [long, *CODE_PROMPTS[:2]], SamplingParams(temperature=0, max_tokens=40)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert len(reference[0]) == 12  # it ran into max_model_len
    llm = LLM(DEMO_MODEL, **kwargs, speculative_config=spec_config("draft_model", DEMO_MODEL, 4))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == reference


def test_a_draft_model_of_another_vocabulary_is_one_line(tmp_path):
    make_tiny_checkpoint("llama", tmp_path / "draft")  # vocab 128
    with pytest.raises(DraftsmithError, match="vocabulary of 128 tokens, the target 8192"):
        _serve(tmp_path / "draft")


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_one_line(tmp_path):
    """Same vocabulary size, two tokens' ids swapped: the draft would propose ids the target reads as other
    tokens, so serving refuses it by name."""
    draft = make_tiny_target_with_tokenizer(tmp_path / "draft")
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "def", "class"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(DraftsmithError, match=r"draft model .*draft has another tokenizer than the target's: 2 tokens "
                                              r"differ \(e.g. 'class': id \d+ in the target's, \d+ in the draft's\)"):
        _serve(draft)
