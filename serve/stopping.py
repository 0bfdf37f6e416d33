"""Deciding when a request is done after new tokens arrive (one per step, or several when speculating)."""

from __future__ import annotations

from draftsmith.serve.request import Request


class StopChecker:
    """Applies EOS, stop token ids, stop strings, max_tokens and the context limit, token by token."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, request: Request, tokens: list[int]) -> int:
        """Appends tokens until one finishes the request; returns how many were kept."""
        params = request.params
        for kept, token in enumerate(tokens, start=1):
            request.output_token_ids.append(token)
            if token in params.stop_token_ids:
                request.stop_reason = token
                request.finish("stop")
                return kept
            if token in self.eos_token_ids and not params.ignore_eos:
                request.finish("stop")
                return kept
            if params.stop and self._hit_stop_string(request):
                request.finish("stop")
                return kept
            if params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
                request.finish("length")
                return kept
            if request.num_tokens >= self.max_model_len:
                request.finish("length")
                return kept
        return len(tokens)

    def _hit_stop_string(self, request: Request) -> bool:
        # Re-decoding the whole output keeps multi-byte characters right; outputs here are short enough.
        previous = len(request.text)
        request.text = self.decode(request.output_token_ids)
        longest = max(len(s) for s in request.params.stop)
        search_from = max(0, previous - longest + 1)
        hits = [(i, s) for s in request.params.stop if (i := request.text.find(s, search_from)) >= 0]
        if hits:
            position, request.stop_reason = min(hits)
            request.text = request.text[:position]  # vLLM drops the stop string from the text
            return True
        return False

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def finalize_text(self, request: Request) -> None:
        if not isinstance(request.stop_reason, str):  # a stop string already cut the text
            request.text = self.decode(request.output_token_ids)
