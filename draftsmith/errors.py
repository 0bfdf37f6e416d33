"""User-facing errors: the CLI prints these as one line and exits non-zero, never a stack trace."""


class DraftsmithError(ValueError):
    """A mistake in the user's input (path, config, flag, request) with a message naming the culprit."""


class UnsupportedModelError(DraftsmithError):
    """The checkpoint's architecture or one of its options is not implemented."""


def format_validation_error(exc, valid_keys=None) -> str:
    """One line from a pydantic `ValidationError`: `dotted.location: message; ...`, plus the valid keys when
    the mistake was an unknown key (the typo users make most)."""
    problems = "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
    )
    if valid_keys and any(e["type"] == "extra_forbidden" for e in exc.errors()):
        problems += f" (valid keys: {', '.join(valid_keys)})"
    return problems
