"""Incremental detokenisation: pieces add up to the full decode, stop strings across token boundaries, and
a cost linear in the output (no full re-decode per token), on the demo model's byte-level BPE tokenizer."""

import random

import pytest
import torch

from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.serve.engine.detokenizer import (
    IncrementalDecoder,
    IncrementalText,
    decode_all,
    stream_backend,
    token_bytes,
)
from draftsmith.serve.engine.request import Request
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.engine.stopping import StopChecker
from helpers import DEMO_MODEL

# Demo tokenizer ids whose bytes split one character: "😀" is three tokens, "é" two (b"\xc3" + b"\xa9").
SMILEY = [1803, 250, 226]
E_ACUTE = [131, 106]
EOS, PAD = 0, 3  # special tokens: skipped when decoding

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "# café, naïve façade 😀 日本\nx = 'ü'  # 👍\n",
    "😀😀é日本語",
]


class CountingTokenizer:
    """The demo tokenizer, counting `decode` calls and the tokens they decode.

    With `fast=False` it hides the `tokenizers` backend, so the decoders take their `tokenizer.decode` path
    (what a slow, pure-Python tokenizer gets).
    """

    def __init__(self, tokenizer, fast: bool):
        self.inner = tokenizer
        self.calls = 0
        self.tokens_decoded = 0
        if fast:
            if stream_backend(tokenizer) is None:
                pytest.skip("tokenizers has no usable DecodeStream (needs >= 0.21.1)")
            self.backend_tokenizer = tokenizer.backend_tokenizer

    def decode(self, token_ids, **kwargs):
        self.calls += 1
        self.tokens_decoded += len(token_ids)
        return self.inner.decode(token_ids, **kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _request(token_ids_so_far=(), **params) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(**params), torch.Generator())
    request.output_token_ids.extend(token_ids_so_far)
    return request


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "decode-window"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_full_decode(tokenizer, text, fast):
    ids = _ids(tokenizer, text)
    ids = ids[:3] + [EOS] + ids[3:] + [PAD]  # special tokens in the middle and at the end
    decoder = IncrementalDecoder(CountingTokenizer(tokenizer, fast))
    pieces = [decoder.extend([token]) for token in ids]
    assert "".join(pieces) == decode_all(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "decode-window"])
def test_a_split_character_waits_for_its_last_byte(tokenizer, fast):
    decoder = IncrementalDecoder(CountingTokenizer(tokenizer, fast))
    assert [decoder.extend([t]) for t in _ids(tokenizer, "ok ") + SMILEY] == ["ok", " ", "", "", "😀"]
    assert [decoder.extend([t]) for t in E_ACUTE] == ["", "é"]
    assert decoder.extend(E_ACUTE + SMILEY[:2]) == "é"  # several tokens at once, the smiley still partial
    assert decoder.num_tokens == 11


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "decode-window"])
def test_random_ids_are_a_prefix_of_the_full_decode(tokenizer, fast):
    """Random ids make invalid UTF-8 too; what is emitted is the full decode minus a held, partial tail."""
    rng = random.Random(0)
    ids = [rng.randrange(len(tokenizer)) for _ in range(400)]
    decoder = IncrementalDecoder(CountingTokenizer(tokenizer, fast))
    text = "".join(decoder.extend(ids[i : i + 3]) for i in range(0, len(ids), 3))
    full = decode_all(tokenizer, ids)
    assert full.startswith(text)
    assert full[len(text) :] == "" or full.endswith("\ufffd")


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "decode-window"])
def test_stop_checker_cost_is_linear(tokenizer, fast):
    """No per-token decode of the whole output: with DecodeStream no tokenizer.decode at all until the
    final text, with the decode window a bounded number of tokens per new token."""
    counting = CountingTokenizer(tokenizer, fast)
    checker = StopChecker(counting, eos_token_ids={EOS}, max_model_len=10_000)
    ids = (_ids(tokenizer, TEXTS[0] + TEXTS[1]) * 20)[:500]
    request = _request(stop=["never appears"], max_tokens=len(ids))
    for token in ids:
        checker.append(request, [token])
    assert request.finish_reason == "length"
    if fast:
        assert counting.calls == 0
    else:
        assert counting.tokens_decoded < 6 * len(ids)  # re-decoding everything would be ~len(ids)**2 / 2
    checker.finalize_text(request)
    assert request.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not checker._decoders


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "decode-window"])
def test_stop_string_across_tokens_and_inside_a_split_character(tokenizer, fast):
    checker = StopChecker(CountingTokenizer(tokenizer, fast), eos_token_ids={EOS}, max_model_len=10_000)
    ids = _ids(tokenizer, "x = 'café' + 1\n")
    assert ids[5:7] == E_ACUTE
    # "fé" spans a plain token and both halves of é: found on é's second byte, and the text is cut before it
    request = _request(stop=["fé", "+"], max_tokens=100)
    kept = [checker.append(request, [token]) for token in ids if not request.finish_reason]
    assert kept == [1] * 7 and request.output_token_ids == ids[:7]
    assert (request.finish_reason, request.stop_reason, request.text) == ("stop", "fé", "x = 'ca")
    checker.finalize_text(request)
    assert request.text == "x = 'ca"


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "decode-window"])
def test_stop_string_in_a_multi_token_step(tokenizer, fast):
    """Speculative steps append several tokens: the ones after the stop are not kept."""
    checker = StopChecker(CountingTokenizer(tokenizer, fast), eos_token_ids={EOS}, max_model_len=10_000)
    ids = _ids(tokenizer, "if 😀 == b:\n    pass\n")
    request = _request(stop=["😀 =", "pass"], max_tokens=100)
    assert checker.append(request, ids[:2]) == 2
    kept = checker.append(request, ids[2:])
    full = decode_all(tokenizer, request.output_token_ids)
    assert request.stop_reason == "😀 =" and full.startswith("if 😀 =") and kept < len(ids) - 2
    assert request.text == "if "


def test_finished_requests_drop_their_decoders(tokenizer):
    checker = StopChecker(tokenizer, eos_token_ids={EOS}, max_model_len=10_000)
    first = _request(stop=["z"])
    checker.append(first, _ids(tokenizer, "abc"))
    other = Request("other", [1], SamplingParams(stop=["z"]), torch.Generator())
    checker.append(other, _ids(tokenizer, "abc"))
    assert sorted(checker._decoders) == ["other", "r"]
    first.finish("abort")
    checker.finalize_text(first)  # what LLMEngine.abort_request and every finished step do
    assert list(checker._decoders) == ["other"]
    other.finish("stop")
    checker.finalize_text(other)
    assert not checker._decoders


def _stream(tokenizer, checker, request, ids, step_sizes, hold_stop, fast):
    """Drives a StopChecker the way the engine does and streams like the API server; returns the deltas."""
    counting = CountingTokenizer(tokenizer, fast)
    stream = IncrementalText(counting, hold_stop)
    deltas, i = [], 0
    while request.finish_reason is None and i < len(ids):
        size = step_sizes[len(deltas) % len(step_sizes)]
        checker.append(request, ids[i : i + size])
        i += size
        finished = request.finish_reason is not None
        if finished:
            checker.finalize_text(request)
        deltas.append(stream.delta(list(request.output_token_ids), finished, request.text if finished else None))
    if fast:
        assert counting.calls == 0  # every delta came from the new tokens only
    return deltas


@pytest.mark.parametrize("fast", [True, False], ids=["DecodeStream", "decode-window"])
@pytest.mark.parametrize("step_sizes", [[1], [3, 1, 4]], ids=["one-token", "speculative"])
@pytest.mark.parametrize("stop", [[], ["日本"], ["é"], ["\n#", "never"]])
def test_streamed_deltas_add_up_to_the_final_text(tokenizer, stop, step_sizes, fast):
    ids = _ids(tokenizer, TEXTS[0] + TEXTS[1] + TEXTS[2])
    checker = StopChecker(tokenizer, eos_token_ids={EOS}, max_model_len=10_000)
    request = _request(stop=stop, max_tokens=len(ids))
    deltas = _stream(tokenizer, checker, request, ids, step_sizes, stop, fast)
    assert "".join(deltas) == request.text
    if stop:
        assert request.stop_reason == stop[0]
        assert request.text == decode_all(tokenizer, request.output_token_ids).split(stop[0])[0]
    else:
        assert request.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len([d for d in deltas if d]) > 3  # it did stream, not only at the end


def test_streaming_without_final_text_decodes_once(tokenizer):
    ids = _ids(tokenizer, TEXTS[1])
    counting = CountingTokenizer(tokenizer, fast=True)
    stream = IncrementalText(counting, [])
    out = [stream.delta(ids[:n], False) for n in range(1, len(ids))] + [stream.delta(ids, True)]
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.calls == 1


def test_decode_stream_restarts_after_an_invalid_prefix(tokenizer):
    """tokenizers raises a bare Exception when a window's text stops extending what was emitted; the
    decoder restarts its stream there instead of failing the request. Other errors propagate."""

    class FlakyStream:
        made = 0

        def __init__(self, skip_special_tokens):
            FlakyStream.made += 1
            self.broken = FlakyStream.made == 1

        def step(self, backend, token):
            if self.broken:
                raise Exception("Invalid prefix encountered while decoding stream")
            return backend.decode([token], skip_special_tokens=True)

    decoder = IncrementalDecoder(CountingTokenizer(tokenizer, fast=True))
    decoder._stream = FlakyStream(skip_special_tokens=True)
    assert decoder.extend(_ids(tokenizer, "ok")) == "ok" and FlakyStream.made == 2
    decoder._stream.step = lambda backend, token: 1 / 0
    with pytest.raises(ZeroDivisionError):
        decoder.extend([5])


def test_token_bytes_are_exact_where_a_token_holds_part_of_a_character():
    """Byte-level BPE splits rare characters over tokens whose own text is U+FFFD; their bytes (chat logprobs'
    `bytes`) must still add up to the text's UTF-8."""
    tokenizer = load_tokenizer(DEMO_MODEL)
    text = "naïve → 日本語 €"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the case this is for
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode()
