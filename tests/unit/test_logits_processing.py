"""vLLM's logits parameters (penalties, logit_bias, min_tokens, bad_words, allowed_token_ids, min_p,
truncate_prompt_tokens): each changes the output as it says, and under speculation (n-gram, EAGLE-3, DFlash,
an EAGLE-3 tree) the output is plain decoding's, token for token, greedy and seeded at temperature 1; the
rejection sampler keeps the processed distribution at every drafted position."""

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.proposer_base import DraftBatch
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.logits_processing import DraftPrefix, LogitsAdjust
from draftsmith.serve.engine.sampling import SamplingBatch, logits_to_probs
from draftsmith.serve.speculation.rejection_reference import rejection_sample_reference
from draftsmith.serve.speculation.verify import verify
from helpers import CODE_PROMPTS, DEMO_MODEL, SPECULATORS

PROMPTS = CODE_PROMPTS[:2]


@pytest.fixture(scope="module")
def plain():
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=256)


def _ids(llm, params, prompts=PROMPTS):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _greedy(**keys):
    return SamplingParams(temperature=0, max_tokens=24, **keys)


def _newline(plain) -> int:
    return plain.tokenizer("\n", add_special_tokens=False).input_ids[-1]


def test_each_parameter_changes_the_output_as_it_says(plain):
    base = _ids(plain, _greedy())
    for keys in ({"repetition_penalty": 1.3}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                 {"presence_penalty": -2.0}):
        assert _ids(plain, _greedy(**keys)) != base, keys
    looping = _ids(plain, _greedy(presence_penalty=-2.0))[0]
    assert len(set(looping)) < len(set(base[0]))  # a negative penalty favours tokens already out
    first = base[0][0]
    assert _ids(plain, _greedy(logit_bias={first: -100}))[0][0] != first
    assert _ids(plain, _greedy(logit_bias={7: 100}))[0][0] == 7
    allowed = list(range(100, 400))
    assert all(100 <= t < 400 for row in _ids(plain, _greedy(allowed_token_ids=allowed)) for t in row)


def test_min_tokens_holds_back_stop_tokens(plain):
    newline = _newline(plain)
    stopped = _ids(plain, _greedy(stop_token_ids=[newline]))
    assert min(len(row) for row in stopped) < 6  # the newline comes early and stops these
    held = _ids(plain, _greedy(stop_token_ids=[newline], min_tokens=6))
    assert all(len(row) >= 6 and newline not in row[:5] for row in held)


def test_bad_words_are_never_generated_at_the_start_or_after_a_space(plain):
    prompt = ["def add(a, b):\n    x = a + b\n"]
    base = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
    assert "assert" in base and "is_integer" in base
    params = SamplingParams(temperature=0, max_tokens=40, bad_words=["assert", "is_integer"])
    text = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    assert "assert" not in text and "is_integer" not in text
    words = params.with_tokenizer(plain.tokenizer).bad_words_token_ids
    assert max(len(w) for w in words) > 1  # a word of several tokens: banned by its last, after the others
    assert {plain.tokenizer.decode(w).strip() for w in words} == {"assert", "is_integer"}


def test_min_p_one_samples_the_argmax(plain):
    greedy = _ids(plain, _greedy())
    sampled = _ids(plain, SamplingParams(temperature=1.0, seed=3, max_tokens=24))
    assert sampled != greedy
    assert _ids(plain, SamplingParams(temperature=1.0, seed=3, max_tokens=24, min_p=1.0)) == greedy


def test_truncate_prompt_tokens_keeps_the_prompt_tail(plain):
    ids = plain.tokenizer(CODE_PROMPTS[1], add_special_tokens=False).input_ids
    out = plain.generate([CODE_PROMPTS[1]], _greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == _ids(plain, _greedy(), [{"prompt_token_ids": ids[-5:]}])[0]


@pytest.mark.parametrize("keys, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {1: 101}}, "logit_bias"), ({"min_tokens": 30, "max_tokens": 8}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")])
def test_out_of_range_values_name_the_parameter(keys, message):
    with pytest.raises(DraftsmithError, match=message):
        SamplingParams(**keys)


def test_token_ids_outside_the_vocabulary_are_refused(plain):
    for keys, name in (({"logit_bias": {10**6: 1.0}}, "logit_bias"), ({"allowed_token_ids": [-1]}, "allowed_token_ids")):
        with pytest.raises(DraftsmithError, match=name):
            plain.generate(PROMPTS[:1], _greedy(**keys), use_tqdm=False)


def _mixed_params(newline: int, temperature: float) -> list[SamplingParams]:
    """Every parameter, one set per request, in one batch; each set twice (one per prompt)."""
    sets = [{"repetition_penalty": 1.3}, {"presence_penalty": 1.5, "frequency_penalty": 0.5},
            {"presence_penalty": -1.0}, {"logit_bias": {newline: -100, 7: 4.0}},
            {"min_tokens": 20, "stop_token_ids": [newline]}, {"bad_words": ["return", "self.assert"]},
            {"allowed_token_ids": list(range(2000))},
            {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "bad_words": [" os.path"], "min_p": 0.05}]
    seeded = {"seed": 11} if temperature else {}
    return [SamplingParams(temperature=temperature, max_tokens=24, **keys, **seeded) for keys in sets for _ in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(SPECULATORS))
def test_speculation_gives_plain_decodings_tokens_under_every_parameter(plain, method):
    newline = _newline(plain)
    prompts = [p for _ in range(8) for p in PROMPTS]
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=256, target=plain.model,
              speculative_config=SPECULATORS[method]())
    for temperature in (0.0, 1.0):
        params = _mixed_params(newline, temperature)
        assert _ids(llm, params, prompts) == _ids(plain, params, prompts), temperature
    assert llm.get_metrics()["num_accepted_tokens"] > 0


class FirstTokenGrammar:
    """A stand-in for a structured-output matcher (`GrammarRow.masks`): after `first`, only `then` and `end`
    may follow; otherwise anything may. The matcher's own masks are tested in test_structured_outputs.py."""

    def __init__(self, vocab: int, first: int, then: int):
        self.vocab, self.first, self.then = vocab, first, then

    def masks(self, prefixes: list[list[int]]) -> torch.Tensor:
        out = torch.ones(len(prefixes), self.vocab, dtype=torch.bool)
        for n, prefix in enumerate(prefixes):
            if prefix[-1:] == [self.first]:
                out[n] = False
                out[n, [self.then, self.vocab - 1]] = True
        return out


def _adjust(rows: int, vocab: int, kind: str, target: torch.Tensor) -> LogitsAdjust:
    """One processing of `target` [1, N, V], for `rows` identical rows. Position-dependent: the penalties;
    min_tokens with one token left before the stop (position 1's likeliest token) may come; a bad word of two
    tokens, position 0's likeliest then position 1's; a grammar that narrows what follows position 0's
    likeliest. The same at every position: a logit bias that also bans a token."""
    zeros = torch.zeros(rows, vocab)
    first, second = target[0, 0].argmax().item(), target[0, 1].argsort(descending=True)[:2].tolist()
    then = second[0] if second[0] != first else second[1]
    stops = zeros.bool().clone()
    stops[:, then] = kind == "min_tokens"
    bias = zeros.clone()
    if kind == "bias":
        bias[:, first], bias[:, then], bias[:, (first + 1) % vocab] = -1.5, float("-inf"), 2.0
    grammar = FirstTokenGrammar(vocab, first, (then + 1) % vocab) if kind == "grammar" else None
    return LogitsAdjust(
        bias=bias, grammars=(grammar,) * rows, min_tokens_left=torch.full((rows,), 1 if kind == "min_tokens" else 0), stop_tokens=stops,
        output_counts=zeros.clone(), in_prompt=zeros.bool(),
        repetition=torch.full((rows,), 1.4 if kind == "penalties" else 1.0),
        frequency=torch.full((rows,), 0.7 if kind == "penalties" else 0.0),
        presence=torch.full((rows,), 1.5 if kind == "penalties" else 0.0),
        penalized=kind == "penalties", bans_stops=kind == "min_tokens",
        bad_sequences=(((first, then),) if kind == "bad_words" else (),) * rows, tails=((),) * rows)


@pytest.mark.parametrize("kind", ["penalties", "min_tokens", "bad_words", "grammar", "bias", "min_p"])
def test_rejection_sampling_keeps_the_processed_distribution_at_each_drafted_position(kind):
    """Trials as rows of one verify (rejection sampling of drafts drawn from q): the first token kept is
    distributed as the processed target p0, and where the first draft x0 was accepted the next one as
    p1( | x0), position 1's processing seeing x0."""
    torch.manual_seed(0)
    trials, vocab, k = 8000, 5, 2
    target = torch.randn(1, k + 1, vocab).expand(trials, -1, -1).contiguous()
    q = torch.softmax(torch.randn(k, vocab), -1)
    draft_tokens = torch.stack([torch.multinomial(q[j], trials, replacement=True) for j in range(k)], 1)
    generators = [torch.Generator().manual_seed(i) for i in range(trials)]
    params = SamplingParams(temperature=1.0, min_p=0.3 if kind == "min_p" else 0.0)
    sampling = SamplingBatch.build([params] * trials, generators, "cpu", adjust=_adjust(trials, vocab, kind, target))
    drafts = DraftBatch(tokens=draft_tokens, counts=torch.full((trials,), k),
                        probs=q[None].expand(trials, -1, -1).contiguous())
    tokens, counts = verify(target, drafts, [k] * trials, sampling, rejection_sample_reference, None)
    plain = SamplingBatch.build([params], [torch.Generator()], "cpu", adjust=_adjust(1, vocab, kind, target))
    p0 = logits_to_probs(plain.processed(target[:1, :1]), plain)[0, 0]
    assert (torch.bincount(tokens[:, 0], minlength=vocab) / trials - p0).abs().max() < 0.02
    gaps = []
    for x0 in range(vocab):
        after = (counts >= 2) & (tokens[:, 0] == x0)
        if after.sum() < 400:
            continue
        p1 = logits_to_probs(plain.processed(target[:1, :2], DraftPrefix.chain(torch.tensor([[x0]]), 2)), plain)[0, 1]
        seen = torch.bincount(tokens[after, 1], minlength=vocab) / after.sum()
        assert (seen - p1).abs().max() < 0.05, x0
        blind = logits_to_probs(plain.processed(target[:1, 1:2]), plain)[0, 0]  # position 1 not seeing x0
        unprocessed = torch.softmax(target[0, 1], -1)
        gaps.append(float((p1 - (unprocessed if kind in ("bias", "min_p") else blind)).abs().max()))
    # what is tested matters here (position 1 seeing x0, or the processing at all), so the test can tell
    assert len(gaps) >= 2 and max(gaps) > 0.15
