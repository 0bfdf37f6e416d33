"""User-facing errors: the CLI prints these as one line and exits non-zero, never a stack trace."""


class DraftsmithError(ValueError):
    """A mistake in the user's input (path, config, flag, request) with a message naming the culprit."""


class UnsupportedModelError(DraftsmithError):
    """The checkpoint's architecture or one of its options is not implemented."""


def format_validation_error(exc, valid_keys=None, skip_loc: tuple[str, ...] = (), whole: str = "config") -> str:
    """One line from a pydantic `ValidationError`: `dotted.location: message; ...`, plus the valid keys when
    the mistake was an unknown key (the typo users make most). `skip_loc` drops location parts that mean
    nothing to the user (FastAPI's "body"); an error about the whole object is labelled `whole` (or not at
    all when `whole` is empty)."""

    def one(error) -> str:
        where = ".".join(str(x) for x in error["loc"] if x not in skip_loc) or whole
        message = error["msg"].removeprefix("Value error, ")
        return f"{where}: {message}" if where else message

    problems = "; ".join(one(e) for e in exc.errors())
    if valid_keys and any(e["type"] == "extra_forbidden" for e in exc.errors()):
        problems += f" (valid keys: {', '.join(valid_keys)})"
    return problems
