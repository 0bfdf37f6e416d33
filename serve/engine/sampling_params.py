"""Per-request sampling settings, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from draftsmith.errors import DraftsmithError
from draftsmith.serve.engine.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's top_logprobs bound, vLLM's default)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range, as vLLM's API bounds it
MAX_REPETITION_PENALTY = 100.0  # past this every seen token is as good as banned; vLLM takes any positive value


def wrap_int64(value: int) -> int:
    """`value` wrapped into int64 (two's complement): sample i of a request seeded s is seeded s + i, which
    may pass INT64_MAX."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy (argmax). top_k <= 0 and top_p == 1 disable those filters. A seeded request
    draws from its own generator, so its output does not depend on what else is in the batch. The logits
    processing fields (penalties, logit_bias, min_tokens, bad_words, allowed_token_ids) and min_p have vLLM's
    names, ranges and meaning (`serve.engine.logits_processing`); greedy rows see them too, except min_p.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    # the generated tokens' logprobs and this many top alternatives at each position (0: the token's alone);
    # None: none
    logprobs: int | None = None
    # the prompt tokens' logprobs (each given the tokens before it; the first has none) and this many top
    # alternatives at each position; None: none
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # minus this from the logit of every token the output holds
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # tokens in the prompt or output: positive logits divided, negative multiplied
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest (after temperature)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are banned until the output holds this many tokens
    bad_words: list[str] | None = None  # never generated, at the start of the text or after a space
    allowed_token_ids: list[int] | None = None  # the only tokens that may be generated
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: as many as the context takes)
    # the output held to a JSON schema, regex, choice or grammar (`structured_outputs`)
    structured_outputs: StructuredOutputsParams | None = None
    # from the tokenizer (`with_tokenizer`): bad_words as token sequences, structured_outputs as a grammar
    bad_words_token_ids: list[list[int]] | None = None
    compiled_grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (disabled), 0 (disabled) or positive"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "must be None or in int64's range"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be None or 0..{MAX_LOGPROBS}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be None or 0..{MAX_LOGPROBS}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"must be in (0, {MAX_REPETITION_PENALTY}]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("logit_bias", all(-100 <= b <= 100 and math.isfinite(b) for b in (self.logit_bias or {}).values()),
             "values must be in [-100, 100]"),
            ("min_tokens", self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "must be >= 0 and at most max_tokens"),
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "must not be empty (None allows every token)"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or self.truncate_prompt_tokens >= 1, "must be None, -1 or >= 1"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise DraftsmithError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the output (and for repetition_penalty the prompt) changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def adjusts_logits(self) -> bool:
        """Whether `logits_processing` has anything to do for this request (min_p lives with the filters)."""
        return bool(self.penalized or self.logit_bias or self.min_tokens or self.bad_words_token_ids
                    or self.allowed_token_ids is not None or self.compiled_grammar)

    def with_tokenizer(self, tokenizer) -> SamplingParams:
        """These params with what needs the tokenizer worked out once: `bad_words_token_ids` and
        `compiled_grammar` (DraftsmithError where a constraint cannot compile)."""
        params = self._with_bad_words_tokenized(tokenizer)
        if params.structured_outputs is not None and params.compiled_grammar is None:
            from draftsmith.serve.engine.structured_outputs import compile_constraint

            params = replace(params, compiled_grammar=compile_constraint(params.structured_outputs, tokenizer))
        return params

    def _with_bad_words_tokenized(self, tokenizer) -> SamplingParams:
        """Each bad word as the tokenizer spells it at the start of a text, and with a leading space where
        that is a different spelling of the same length (vLLM's rule: a word is banned at the start and in
        the middle of text)."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        if tokenizer is None:
            raise DraftsmithError("bad_words need a tokenizer, and this engine has none (skip_tokenizer_init)")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            bare = tokenizer(word.lstrip(), add_special_tokens=False).input_ids
            spaced = tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids
            if not bare:
                raise DraftsmithError(f"bad_words: {word!r} has no tokens")
            sequences.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        return replace(self, bad_words_token_ids=sequences)
