"""Incremental detokenisation: text for a growing token list at a cost proportional to the new tokens.

Re-decoding the whole output on every token is quadratic in the output length. `IncrementalDecoder` decodes
only a short window, and `IncrementalText` turns that into streamed deltas. Concatenated, the pieces equal
`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)` for the same ids,
apart from a trailing incomplete character that is never emitted. Stop checking and streaming never apply
the WordPiece space clean-up (nor does vLLM), because it cannot be applied piece by piece.
"""

from __future__ import annotations

import functools

# tokenizers raises this untyped when the window's text stops starting with what was already emitted.
_INVALID_PREFIX = "Invalid prefix encountered"
_INCOMPLETE = "\ufffd"  # what decode yields for a UTF-8 character whose bytes have not all arrived


def decode_all(tokenizer, token_ids: list[int]) -> str:
    """The reference text of `token_ids`: what the pieces of an `IncrementalDecoder` add up to."""
    return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for: exact for byte-level BPE (where a token may hold part of a UTF-8
    character, whose decoded text is U+FFFD), else its decoded text's UTF-8."""
    import tokenizers

    backend = stream_backend(tokenizer)
    if backend is not None and isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
        piece, table = tokenizer.convert_ids_to_tokens(token_id), _byte_level_table()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return tokenizer.decode([token_id]).encode()


@functools.cache
def _byte_level_table() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def stream_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind a fast tokenizer when `DecodeStream` can drive it, else None."""
    import tokenizers

    # (pyproject requires tokenizers >= 0.21.1: 0.21.0's DecodeStream panics on a character split over tokens)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, tokenizers.Tokenizer) else None


class IncrementalDecoder:
    """The text of one growing token list, decoded a few tokens at a time.

    A fast tokenizer goes through `tokenizers.decoders.DecodeStream`. Any other tokenizer gets the same
    algorithm through `tokenizer.decode`: decode the tokens of the last emitted piece plus the new ones,
    and emit what the new ones added, unless the text ends in U+FFFD (a character cut mid-way). The last
    piece's tokens are decoded again as context, so merges and leading-space rules see their neighbours.
    """

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.num_tokens = 0  # tokens consumed so far
        self._backend = stream_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        # window state of the tokenizer.decode path
        self._window: list[int] = []
        self._prefix = ""  # decode of the window's first `_prefix_len` tokens (the last emitted piece)
        self._prefix_len = 0

    def extend(self, token_ids: list[int]) -> str:
        """Consumes `token_ids` and returns the text they complete ("" while a character is still partial)."""
        self.num_tokens += len(token_ids)
        return "".join(self._step(token) for token in token_ids)

    def _step(self, token: int) -> str:
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token) or ""
            except Exception as exc:  # tokenizers gives no type to catch: see _INVALID_PREFIX
                if not str(exc).startswith(_INVALID_PREFIX):
                    raise
                # Restart from this token without context, as vLLM does; the rest of the text stays right.
                self._stream = type(self._stream)(skip_special_tokens=True)
                return self._stream.step(self._backend, token) or ""
        self._window.append(token)
        text = decode_all(self.tokenizer, self._window)
        if len(text) <= len(self._prefix) or text.endswith(_INCOMPLETE):
            return ""
        piece = text[len(self._prefix):]
        del self._window[: self._prefix_len]
        self._prefix = decode_all(self.tokenizer, self._window)
        self._prefix_len = len(self._window)
        return piece


class IncrementalText:
    """Turns a growing token list into streamed text deltas.

    When stop strings are set, holds back the last `longest stop - 1` characters, which might still turn out
    to be the start of a stop string that the final text drops. At the end the engine's final text (stop
    string already cut) settles the rest, so the deltas always add up to exactly that text.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.decoder = IncrementalDecoder(tokenizer)
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded, not yet sent: at most `hold` characters between calls
        self.sent = 0  # characters already streamed

    def delta(self, token_ids: list[int], finished: bool, final_text: str | None = None) -> str:
        """The text to stream now; `token_ids` is the whole output so far, of which only new ids are decoded."""
        if finished:
            text = final_text if final_text is not None else decode_all(self.decoder.tokenizer, token_ids)
            out, self.sent = text[self.sent :], len(text)
            return out
        self.pending += self.decoder.extend(token_ids[self.decoder.num_tokens :])
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return ""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += len(out)
        return out
