"""Proposer registry: one dict, a decorator that rejects duplicates, resolved once per engine."""

from __future__ import annotations

from collections.abc import Callable

from draftsmith.errors import DraftsmithError

_PROPOSERS: dict[str, type] = {}


def register_proposer(name: str) -> Callable[[type], type]:
    def decorate(cls: type) -> type:
        if name in _PROPOSERS:
            raise ValueError(f"proposer {name!r} is already registered by {_PROPOSERS[name].__name__}")
        cls.method = name
        _PROPOSERS[name] = cls
        return cls

    return decorate


def available_methods() -> list[str]:
    _import_builtin_proposers()
    return sorted(_PROPOSERS)


def resolve_proposer(name: str) -> type:
    _import_builtin_proposers()
    if name not in _PROPOSERS:
        raise DraftsmithError(f"no proposer {name!r}; available: {', '.join(sorted(_PROPOSERS))}")
    return _PROPOSERS[name]


def _import_builtin_proposers() -> None:
    # Registration happens on import; importing here (not at module top) avoids a config <-> proposer cycle.
    from draftsmith.serve.spec import eagle, ngram  # noqa: F401
