"""The OpenAI-compatible HTTP server: the app, its protocol, metrics, limits and `draftsmith serve`."""
