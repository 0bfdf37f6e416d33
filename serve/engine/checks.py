"""What a request must be for an engine to take it, checked once where it enters: the server's edge, or
`LLM.generate`, or `LLMEngine.add_request` for callers that step an engine themselves. A `CheckedRequest`
is the proof; the engine's `add` takes it without checking again."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.errors import DraftsmithError
from draftsmith.serve.engine.sampling_params import SamplingParams


class PromptRefused(DraftsmithError):
    """The prompt's ids cannot run: empty, too long for the context, or outside the vocabulary."""


@dataclass(frozen=True)
class CheckedRequest:
    """A prompt and its sampling parameters that passed `RequestLimits.check` (made only there)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can hold: a request's tokens (prompt plus output), its vocabulary, its cache slots."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> CheckedRequest:
        """The request, checked: its prompt fits the context and vocabulary (else PromptRefused), its n
        samples fit the slots and its stop tokens the vocabulary (else DraftsmithError)."""
        keep = params.truncate_prompt_tokens
        if keep is not None:  # vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens
            prompt_token_ids = prompt_token_ids[-(self.max_model_len - 1 if keep == -1 else keep):]
        self.check_prompt(prompt_token_ids)
        if params.n > self.max_num_seqs:
            raise DraftsmithError(f"n={params.n} samples run at once, one cache slot each, but max_num_seqs is "
                                  f"{self.max_num_seqs}")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("bad_words", [t for word in params.bad_words_token_ids or [] for t in word])):
            if any(not 0 <= token < self.vocab_size for token in ids):
                raise DraftsmithError(f"{name}: token ids must be in [0, {self.vocab_size})")
        return CheckedRequest(list(prompt_token_ids), params, prompt)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise PromptRefused("prompt is empty: at least one token is needed")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptRefused(f"prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                                f"{self.max_model_len} (prompt plus at least one generated token must fit)")
        if max(prompt_token_ids) >= self.vocab_size or min(prompt_token_ids) < 0:
            raise PromptRefused(f"prompt token ids must be in [0, {self.vocab_size})")
