"""The method registry: one dict, a decorator that rejects duplicates, lookups whose errors list the names.

Every list of methods a user sees (CLI choices, recipe head types, `--speculative-config` errors, the
convert formats' head types) is derived from this registry, so a new method appears everywhere by
registering once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.methods.base import SpecMethod

METHODS: dict[str, type[SpecMethod]] = {}
# Names vLLM's --speculative-config knows that no registered method implements yet: accepted as words,
# refused with "not available yet" rather than "unknown", so a vLLM user sees it is planned, not a typo.
VLLM_METHOD_NAMES = ("ngram", "suffix", "medusa", "mlp_speculator", "draft_model", "eagle", "eagle3", "dflash", "mtp")

_version = 0  # bumped on every registration, so schemas built from the registry know when to rebuild


def register_method(cls: type[SpecMethod]) -> type[SpecMethod]:
    """Class decorator: registers `cls` under `cls.name`."""
    global _version
    name = cls.name
    if not name:
        raise ValueError(f"{cls.__name__} has no name")
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered by {METHODS[name].__name__}")
    section_method = cls.section.model_fields["method"].annotation
    if getattr(section_method, "__args__", None) != (name,):
        raise ValueError(f"{cls.__name__}.section must declare method: Literal[{name!r}]")
    METHODS[name] = cls
    _version += 1
    return cls


def unregister_method(name: str) -> None:
    """For tests that register a throw-away method."""
    global _version
    METHODS.pop(name, None)
    _version += 1


def registry_version() -> int:
    return _version


def method_names(where: Callable[[type[SpecMethod]], bool] = lambda m: True) -> list[str]:
    return sorted(name for name, method in METHODS.items() if where(method))


def servable(method: type[SpecMethod]) -> bool:
    return method.proposer_class() is not None


def trainable(method: type[SpecMethod]) -> bool:
    return method.recipe_section is not None and method.objective() is not None


def resolve_method(name: str) -> type[SpecMethod]:
    if name in METHODS:
        return METHODS[name]
    raise DraftsmithError(unknown_method_message(name))


def unknown_method_message(name: str, role: str = "") -> str:
    """`name` is not registered (or cannot be `role`: "served", "trained"): say which methods can."""
    able = method_names(servable if role == "served" else trainable if role == "trained" else lambda m: True)
    if name in METHODS or name in VLLM_METHOD_NAMES:
        return f"method {name!r} is not available yet; available: {', '.join(able)}"
    return f"method {name!r} is unknown; available: {', '.join(able)}"


def head_method(head_type: str | None, where: str | Path = "") -> type[SpecMethod]:
    """The method whose native head format is `head_type` (the `draftsmith_head_type` of a config.json)."""
    for method in METHODS.values():
        if method.head_type is not None and method.head_type == head_type:
            return method
    known = sorted(m.head_type for m in METHODS.values() if m.head_type)
    prefix = f"{where}: " if where else ""
    raise DraftsmithError(f"{prefix}draftsmith_head_type {head_type!r} is not one of {known} "
                          "(convert foreign checkpoints with `draftsmith convert`)")
