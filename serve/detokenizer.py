"""Incremental text for streaming: deltas that add up exactly to the final (non-streamed) text."""

from __future__ import annotations


class IncrementalText:
    """Turns a growing token list into text deltas.

    Holds back a trailing U+FFFD (a multi-byte character cut mid-way) and, when stop strings are set, the
    last `longest stop - 1` characters, which might still turn out to be the start of a stop string that the
    final text drops. At the end the engine's final text (stop string already cut) settles the rest.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0  # characters already streamed

    def delta(self, token_ids: list[int], finished: bool, final_text: str | None = None) -> str:
        if finished:
            text = final_text if final_text is not None else self._decode(token_ids)
            out, self.sent = text[self.sent :], len(text)
            return out
        text = self._decode(token_ids)
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        safe = max(self.sent, len(text) - self.hold)
        out, self.sent = text[self.sent : safe], safe
        return out

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
