"""Per-request sampling settings, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.errors import DraftsmithError

MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's top_logprobs bound, vLLM's default)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range, as vLLM's API bounds it


def wrap_int64(value: int) -> int:
    """`value` wrapped into int64 (two's complement): sample i of a request seeded s is seeded s + i, which
    may pass INT64_MAX."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy (argmax). top_k <= 0 and top_p == 1 disable those filters. A seeded request
    draws from its own generator, so its output does not depend on what else is in the batch.
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
        ]
        for name, ok, why in checks:
            if not ok:
                raise DraftsmithError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
