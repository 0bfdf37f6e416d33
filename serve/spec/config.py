"""`--speculative-config`: vLLM's JSON keys, validated with pydantic (unknown keys are errors)."""

from __future__ import annotations

import json
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from draftsmith.errors import DraftsmithError

# Every method vLLM names; only the registered ones run (see registry.available_methods()).
RESERVED_METHODS = ("ngram", "eagle", "eagle3", "mlp_speculator", "mtp", "medusa", "draft_model", "suffix")


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = Field(default=None, gt=0, le=64)
    # vLLM: both unset -> 5 and 5; one unset -> mirrors the other; min > max is an error.
    prompt_lookup_min: int | None = Field(default=None, ge=1)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    draft_tensor_parallel_size: int | None = None
    rejection_sample_method: Literal["strict", "probabilistic", "synthetic"] = "strict"
    # Benchmarking only: each draft token is accepted with this probability whatever it is, so the
    # output is NOT the target's distribution. Never serve users with it.
    synthetic_acceptance_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    suffix_decoding_max_tree_depth: int = Field(default=24, ge=1)
    suffix_decoding_max_cached_requests: int = Field(default=10000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(default=1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(default=0.1, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        from draftsmith.serve.spec.registry import available_methods

        if self.method not in available_methods():
            reserved = self.method in RESERVED_METHODS
            raise ValueError(
                f"method {self.method!r} is {'not available yet' if reserved else 'unknown'}; "
                f"available: {', '.join(available_methods())}"
                + ("" if reserved else f" (reserved: {', '.join(RESERVED_METHODS)})")
            )
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"draft_tensor_parallel_size={self.draft_tensor_parallel_size}: only 1 is supported")
        if self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens is required for method {self.method!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} is greater than prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        synthetic = self.rejection_sample_method == "synthetic"
        if synthetic != (self.synthetic_acceptance_rate is not None):
            raise ValueError("synthetic_acceptance_rate is required with, and only with, "
                             "rejection_sample_method='synthetic'")
        return self

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """Accepts a config, a dict or a JSON string; a user mistake becomes one `DraftsmithError`."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise DraftsmithError(f"speculative config is not valid JSON: {exc.msg} at column {exc.colno}") from None
        if not isinstance(value, dict):
            raise DraftsmithError("speculative config must be a JSON object")
        try:
            return cls(**value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            )
            valid = ", ".join(cls.model_fields)
            hint = f" (valid keys: {valid})" if any(e["type"] == "extra_forbidden" for e in exc.errors()) else ""
            raise DraftsmithError(f"invalid speculative config: {problems}{hint}") from None


def from_legacy_kwargs(speculative_model: str | None = None, num_speculative_tokens: int | None = None,
                       ngram_prompt_lookup_max: int | None = None,
                       ngram_prompt_lookup_min: int | None = None) -> dict[str, Any] | None:
    """Maps vLLM's old `speculative_model="[ngram]"` style arguments onto the config, with a warning."""
    if speculative_model is None:
        if num_speculative_tokens is not None or ngram_prompt_lookup_max is not None:
            raise DraftsmithError("num_speculative_tokens / ngram_prompt_lookup_* need speculative_model")
        return None
    warnings.warn("speculative_model= / num_speculative_tokens= / ngram_prompt_lookup_*= are deprecated; "
                  "pass speculative_config={...} instead", DeprecationWarning, stacklevel=3)
    config: dict[str, Any] = {"num_speculative_tokens": num_speculative_tokens}
    if speculative_model == "[ngram]":
        config["method"] = "ngram"
    else:
        config.update(method="draft_model", model=speculative_model)
    if ngram_prompt_lookup_max is not None:
        config["prompt_lookup_max"] = ngram_prompt_lookup_max
    if ngram_prompt_lookup_min is not None:
        config["prompt_lookup_min"] = ngram_prompt_lookup_min
    return config
