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
# Methods vLLM's --speculative-config knows that draftsmith has not registered yet: refused with "not
# available yet" rather than "unknown", so a vLLM user sees it is planned, not a typo.
PLANNED_METHODS: tuple[str, ...] = ()


def register_method(cls: type[SpecMethod]) -> type[SpecMethod]:
    """Class decorator: registers `cls` under `cls.name`."""
    name = cls.name
    if not name:
        raise ValueError(f"{cls.__name__} has no name")
    if name in METHODS:
        raise ValueError(f"method {name!r} is already registered by {METHODS[name].__name__}")
    section_method = cls.section.model_fields["method"].annotation
    if getattr(section_method, "__args__", None) != (name,):
        raise ValueError(f"{cls.__name__}.section must declare method: Literal[{name!r}]")
    if cls.recipe_section is not None:
        recipe_head = cls.recipe_section.model_fields["head_type"].annotation
        if getattr(recipe_head, "__args__", None) != (name,):
            raise ValueError(f"{cls.__name__}.recipe_section must declare head_type: Literal[{name!r}]")
    # A native head's `draftsmith_head_type` names the method that runs it: one word for both, so a head
    # directory, a recipe's head_type and a --speculative-config method always agree.
    if cls.head_type not in (None, name):
        raise ValueError(f"{cls.__name__}.head_type must be None or {name!r}, not {cls.head_type!r}")
    METHODS[name] = cls
    return cls


def unregister_method(name: str) -> None:
    """For tests that register a throw-away method."""
    METHODS.pop(name, None)


def method_names(where: Callable[[type[SpecMethod]], bool] = lambda m: True) -> list[str]:
    return sorted(name for name, method in METHODS.items() if where(method))


def servable(method: type[SpecMethod]) -> bool:
    return method.proposer_class() is not None


def trainable(method: type[SpecMethod]) -> bool:
    # declarative: asking for the objective would import training code into every process that lists methods
    return method.recipe_section is not None


def resolve_method(name: str) -> type[SpecMethod]:
    if name in METHODS:
        return METHODS[name]
    raise DraftsmithError(unknown_method_message(name))


def unknown_method_message(name: str, role: str = "") -> str:
    """`name` is not registered (or cannot be `role`: "served", "trained"): say which methods can."""
    able = method_names(servable if role == "served" else trainable if role == "trained" else lambda m: True)
    if name in METHODS and role == "trained":
        return f"method {name!r} trains no head; trainable: {', '.join(able)}"
    if name in METHODS or name in PLANNED_METHODS:
        return f"method {name!r} is not available yet; available: {', '.join(able)}"
    return f"method {name!r} is unknown; available: {', '.join(able)}"


def head_method(head_type: str | None, where: str | Path = "") -> type[SpecMethod]:
    """The method whose native head format is `head_type` (the `draftsmith_head_type` of a config.json)."""
    method = METHODS.get(head_type) if isinstance(head_type, str) else None
    if method is not None and method.head_type is not None:
        return method
    known = sorted(m.head_type for m in METHODS.values() if m.head_type)
    prefix = f"{where}: " if where else ""
    raise DraftsmithError(f"{prefix}draftsmith_head_type {head_type!r} is not one of {known} "
                          "(convert foreign checkpoints with `draftsmith convert`)")
