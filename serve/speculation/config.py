"""`--speculative-config`: vLLM's JSON keys, validated by pydantic against the union of the registered
methods' sections, discriminated by `method` (unknown keys are errors that list the method's keys)."""

from __future__ import annotations

import json
import warnings
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from draftsmith.errors import DraftsmithError, format_validation_error
from draftsmith.methods import METHODS, SpeculativeConfig, resolve_method, servable
from draftsmith.methods.registry import unknown_method_message

__all__ = ["SpeculativeConfig", "from_legacy_kwargs", "parse_speculative_config"]

_schema: tuple[tuple, TypeAdapter] | None = None


def speculative_config_schema() -> TypeAdapter:
    """The union of every servable method's section; rebuilt when the set of sections changes."""
    global _schema
    sections = tuple(m.section for m in METHODS.values() if servable(m))
    if _schema is None or _schema[0] != sections:
        union = Annotated[Union[sections], Field(discriminator="method")] if len(sections) > 1 else sections[0]  # noqa: UP007
        _schema = (sections, TypeAdapter(union))
    return _schema[1]


def parse_speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """Accepts a config, a dict or a JSON string; a user mistake becomes one `DraftsmithError`. A config object
    goes through the same checks (its method's own section, the method's needs) as the JSON would."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        value = value.model_dump()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"speculative config is not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(value, dict):
        raise DraftsmithError("speculative config must be a JSON object")
    name = value.get("method")
    if not isinstance(name, str):
        raise DraftsmithError("invalid speculative config: \"method\" (a string) is required")
    if name not in METHODS or not servable(METHODS[name]):
        raise DraftsmithError(f"invalid speculative config: {unknown_method_message(name, 'served')}")
    method = resolve_method(name)
    try:
        config = speculative_config_schema().validate_python(value)
    except ValidationError as exc:
        raise DraftsmithError("invalid speculative config: "
                              + format_validation_error(_Untagged(exc, name), list(method.section.model_fields))) from None
    if method.needs.head and not config.model:
        raise DraftsmithError(f"invalid speculative config: method {name!r} needs \"model\": the draft head directory")
    if config.draft_sample_method == "probabilistic" and not method.needs.draft_probs:
        able = [n for n, m in sorted(METHODS.items()) if servable(m) and m.needs.draft_probs]
        raise DraftsmithError(f"invalid speculative config: method {name!r} drafts deterministically, so it has no "
                              f"draft probabilities for draft_sample_method 'probabilistic' (methods that do: "
                              f"{', '.join(able)})")
    return config


class _Untagged:
    """A union's ValidationError with its tag ("ngram") dropped from the error locations: the user wrote the
    keys at the top level of the config."""

    def __init__(self, exc: ValidationError, tag: str):
        self._errors = [{**e, "loc": e["loc"][1:] if e["loc"][:1] == (tag,) else e["loc"]} for e in exc.errors()]

    def errors(self):
        return self._errors


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
