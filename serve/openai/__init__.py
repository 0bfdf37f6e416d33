"""The OpenAI-compatible HTTP server: the app (`app.build_app`) and a module per endpoint, its protocol, errors,
metrics, limits and `draftsmith serve`."""
