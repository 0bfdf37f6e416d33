"""Deciding when a request is done after new tokens arrive (one per step, or several when speculating)."""

from __future__ import annotations

from draftsmith.serve.engine.detokenizer import IncrementalDecoder, decode_all
from draftsmith.serve.engine.request import Request


class StopChecker:
    """Applies EOS, stop token ids, stop strings, max_tokens and the context limit, token by token.

    For a request with stop strings, `request.text` is kept current by decoding only the new tokens; the
    per-request decoders live here, keyed by request id, until `finalize_text`.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._decoders: dict[str, tuple[Request, IncrementalDecoder]] = {}

    def append(self, request: Request, tokens: list[int]) -> int:
        """Appends tokens until one finishes the request; returns how many were kept."""
        params = request.params
        for kept, token in enumerate(tokens, start=1):
            request.output_token_ids.append(token)
            # vLLM's min_tokens: no stop token or EOS ends the output before it holds min_tokens tokens, no
            # stop string before it holds more
            held = len(request.output_token_ids) < params.min_tokens
            if token in params.stop_token_ids and not held:
                request.stop_reason = token
                request.finish("stop")
                return kept
            if token in self.eos_token_ids and not params.ignore_eos and not held:
                request.finish("stop")
                return kept
            if params.stop and self._hit_stop_string(request, len(request.output_token_ids) > params.min_tokens):
                request.finish("stop")
                return kept
            if params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
                request.finish("length")
                return kept
            if request.num_tokens >= self.max_model_len:
                request.finish("length")
                return kept
        return len(tokens)

    def _hit_stop_string(self, request: Request, search: bool = True) -> bool:
        """Keeps `request.text` current and, where `search`, looks for a stop string in what is new."""
        decoder = self._decoder(request)
        piece = decoder.extend(request.output_token_ids[decoder.num_tokens :])
        if not piece:
            return False
        previous = len(request.text)
        request.text += piece
        if not search:
            return False
        # A stop string may have started up to len - 1 characters before the new piece.
        search_from = max(0, previous - max(len(s) for s in request.params.stop) + 1)
        hits = [(i, s) for s in request.params.stop if (i := request.text.find(s, search_from)) >= 0]
        if hits:
            position, request.stop_reason = min(hits)
            request.text = request.text[:position]  # vLLM drops the stop string from the text
            return True
        return False

    def _decoder(self, request: Request) -> IncrementalDecoder:
        entry = self._decoders.get(request.request_id)
        if entry is None or entry[0] is not request:  # finished and aborted requests drop theirs in finalize_text
            entry = self._decoders[request.request_id] = (request, IncrementalDecoder(self.tokenizer))
        return entry[1]

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else decode_all(self.tokenizer, token_ids)  # no tokenizer: ids only

    def finalize_text(self, request: Request) -> None:
        """Sets the final text of a finished request (one decode of the whole output) and drops its decoder."""
        self._decoders.pop(request.request_id, None)
        if not isinstance(request.stop_reason, str):  # a stop string already cut the text
            request.text = self.decode(request.output_token_ids)
