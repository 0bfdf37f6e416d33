"""User-facing errors: the CLI prints these as one line and exits non-zero, never a stack trace."""


class DraftsmithError(ValueError):
    """A mistake in the user's input (path, config, flag, request) with a message naming the culprit."""


class UnsupportedModelError(DraftsmithError):
    """The checkpoint's architecture or one of its options is not implemented."""
