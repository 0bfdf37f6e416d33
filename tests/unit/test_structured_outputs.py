"""Structured outputs through llguidance: JSON schemas, json_object, regex, choice and grammars hold the output,
exactly as plain decoding does under speculation (n-gram, EAGLE-3, DFlash, an EAGLE-3 tree; greedy and seeded
at temperature 1), and a constraint that cannot compile is one clear error."""

import json
import re

import jsonschema
import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.structured_outputs import GrammarRow, StructuredOutputsParams, compile_constraint
from helpers import CODE_PROMPTS, DEMO_MODEL, SPECULATORS

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
CONSTRAINTS = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json_object=True),
               StructuredOutputsParams(regex=r"[a-z]{2,6}_\d{2}"),
               StructuredOutputsParams(choice=["yes", "no", 'say "maybe"']),
               StructuredOutputsParams(grammar='start: "def " NAME "(" NAME? ")"\nNAME: /[a-z_]{1,12}/')]
# 50 prompts: the code prompts, numbered, so that no two are alike
PROMPTS = [f"# task {i}\n{CODE_PROMPTS[i % len(CODE_PROMPTS)]}" for i in range(50)]


@pytest.fixture(scope="module")
def plain():
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=256)


def _outputs(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _holds(constraint: StructuredOutputsParams, text: str) -> bool:
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
        return True
    if constraint.json_object:
        return isinstance(json.loads(text), dict)
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    if constraint.choice is not None:
        return text in constraint.choice
    return re.fullmatch(r"def [a-z_]{1,12}\(([a-z_]{1,12})?\)", text) is not None


def test_every_kind_of_constraint_holds_the_output_and_changes_it(plain):
    free = _outputs(plain, CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=48))
    for constraint in CONSTRAINTS:
        outs = _outputs(plain, CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint))
        for out, unconstrained in zip(outs, free):
            assert out.finish_reason == "stop" and _holds(constraint, out.text), (constraint, out.text)
            assert out.text != unconstrained.text


@pytest.mark.slow
def test_json_schema_outputs_validate_on_50_prompts_with_and_without_speculation(plain):
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON))
    spec = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=256, target=plain.model,
               speculative_config=SPECULATORS["eagle3"]())
    for llm in (plain, spec):
        for out in _outputs(llm, PROMPTS, params):
            jsonschema.validate(json.loads(out.text), PERSON)
    assert spec.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", list(SPECULATORS))
def test_speculation_gives_plain_decodings_tokens_under_every_constraint(plain, method):
    prompts = [p for p in CODE_PROMPTS[:2] for _ in CONSTRAINTS]
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=256, target=plain.model,
              speculative_config=SPECULATORS[method]())
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, max_tokens=40, seed=7, structured_outputs=c, presence_penalty=0.5)
                  for _ in CODE_PROMPTS[:2] for c in CONSTRAINTS]
        got, want = _outputs(llm, prompts, params), _outputs(plain, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], temperature
        assert all(_holds(c, o.text) for c, o in zip(CONSTRAINTS * 2, want) if o.finish_reason == "stop")
    assert llm.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("keys, message", [
    ({"json": {"type": "bogus"}}, "bogus"), ({"regex": "("}, "unclosed group"), ({"grammar": "start: foo("}, "Expected"),
    ({"json": "{not json"}, "structured_outputs"), ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "at least one")])
def test_a_constraint_that_cannot_compile_is_one_clear_error(plain, keys, message):
    with pytest.raises(DraftsmithError, match=message):
        compile_constraint(StructuredOutputsParams(**keys), plain.tokenizer)


def test_masks_after_drafts_are_the_matchers_after_consuming_them_and_nothing_moves(plain):
    tokenizer = plain.tokenizer
    grammar = compile_constraint(StructuredOutputsParams(json=PERSON), tokenizer)
    row = GrammarRow(grammar, tokenizer, len(tokenizer), [0])
    text = tokenizer('{"name": "ab", "age": 7', add_special_tokens=False).input_ids
    masks = row.masks([text[:n] for n in range(len(text) + 1)] + [[tokenizer("}", add_special_tokens=False).input_ids[0]]])
    for n in range(len(text) + 1):
        fresh = GrammarRow(grammar, tokenizer, len(tokenizer), [0])
        fresh.sync(text[:n])
        assert torch.equal(masks[n], fresh.masks([[]])[0])
        if n < len(text):
            assert masks[n][text[n]]  # the text's own next token is allowed
    assert masks[-1].all()  # "}" first is refused: that prefix cannot be reached, its row is left open
    assert torch.equal(row.masks([[]])[0], GrammarRow(grammar, tokenizer, len(tokenizer), [0]).masks([[]])[0])
    forced = row.forced_tokens()  # the schema's first key is required: the grammar writes it alone
    assert forced == text[: len(forced)] and tokenizer.decode(forced).startswith('{"name"')


def test_grammar_drafts_give_one_token_decodings_output_in_fewer_forwards(plain, monkeypatch):
    """A plain engine verifies what the grammar forces (a required key and its ': ') in one forward: the same
    ids as decoding one token a forward, greedy and seeded, penalties included, in fewer forwards."""
    params = [SamplingParams(temperature=t, seed=3, max_tokens=60, presence_penalty=0.4,
                             structured_outputs=StructuredOutputsParams(json=PERSON)) for t in (0.0, 1.0)]
    prompts = CODE_PROMPTS[:2]

    def run():
        before = dict(plain.engine.stats)
        ids = [[o.token_ids for o in _outputs(plain, prompts, [p] * len(prompts))] for p in params]
        return ids, {k: plain.engine.stats.get(k, 0) - before.get(k, 0) for k in plain.engine.stats}

    with_drafts, used = run()
    monkeypatch.setattr(type(plain.engine.logits_state), "forced_tokens", lambda self, rows, limits: None)
    one_by_one, spent = run()
    assert with_drafts == one_by_one
    assert used["num_forced_tokens"] > 10
    assert used["num_forward_passes"] < spent["num_forward_passes"] - 10


def test_a_model_vocabulary_past_the_tokenizers_is_masked_whole(plain):
    """Qwen2's config counts 151936 tokens for a tokenizer of 151665: the mask covers the model's vocabulary,
    and the ids past the tokenizer's are never allowed."""
    grammar = compile_constraint(StructuredOutputsParams(regex="[a-z]+"), plain.tokenizer)
    small, large = (GrammarRow(grammar, plain.tokenizer, vocab, [0]).masks([[]])[0] for vocab in (8192, 8256))
    assert large.shape == (8256,) and torch.equal(large[:8192], small) and not large[8192:].any()


def test_a_grammar_does_not_outlive_its_request_in_a_reused_slot(plain):
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256, target=plain.model)
    regex = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[a-z]{12}"))
    _outputs(llm, ["x = "], regex)  # ends at max_tokens, inside its regex
    forced = llm.get_metrics()["num_forced_tokens"]
    _outputs(llm, CODE_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12))
    assert llm.get_metrics()["num_forced_tokens"] == forced and llm.engine.logits_state.grammars == [None]


def test_a_finished_grammar_under_min_tokens_ends_with_eos_not_an_arbitrary_token(plain):
    """The grammar allows only EOS once "yes" is written, and min_tokens bans EOS: nothing would be left, so
    EOS comes back (the output runs on to min_tokens with it, as vLLM does) instead of an argmax over nothing."""
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=4,
                            structured_outputs=StructuredOutputsParams(choice=["yes"]))
    [out] = _outputs(plain, CODE_PROMPTS[:1], params)
    eos = plain.tokenizer.eos_token_id
    assert out.text == "yes" and out.finish_reason == "stop" and len(out.token_ids) == 4
    assert out.token_ids[-2:] == [eos, eos]
