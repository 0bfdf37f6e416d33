"""What every route of the server shares: the server's settings (`ServerOptions`) and `ServerState`, which
`build_app` makes once and hands to each router factory."""

from __future__ import annotations

import dataclasses

from draftsmith.serve.client.engine_client import EngineClient
from draftsmith.serve.client.frontend import Frontend
from draftsmith.serve.client.output_streams import DEFAULT_MAX_BACKLOG
from draftsmith.serve.openai.http_limits import DEFAULT_MAX_BODY_BYTES
from draftsmith.serve.openai.metrics import ServerMetrics


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """The server's own settings (`draftsmith serve` flags of the same names)."""

    api_key: str | None = None  # required on every route but /health (and /metrics when public_metrics)
    public_metrics: bool = False
    max_queue: int = 256  # requests that may wait for cache slots; more get 503 at once
    shutdown_timeout: float = 30.0  # after SIGTERM, in-flight requests get this long, then an error
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413 unread
    max_stream_backlog: int = DEFAULT_MAX_BACKLOG  # unread tokens + logprobs a stream may hold (`output_streams`)
    max_engine_restarts: int = 3  # engine process restarts within engine_process.RESTART_WINDOW_S


@dataclasses.dataclass(frozen=True)
class ServerState:
    """What the routes of one server share.

    Attributes:
        engine: runs the requests (on a thread of this process, or in an engine process).
        frontend: the engine's tokenizer, chat template and prompt checks; the API process holds no weights.
        metrics: the server's Prometheus metrics.
        options: the server's settings.
        model_name: the one model name the server answers to (`--served-model-name`).
    """

    engine: EngineClient
    frontend: Frontend
    metrics: ServerMetrics
    options: ServerOptions
    model_name: str

    @property
    def max_model_len(self) -> int:
        """Prompt and generated tokens one request may hold; also the default and largest max_tokens."""
        return self.frontend.max_model_len

    def count_failure(self, status: int) -> None:
        """Counts a request answered with an error `status` (refused at the edge, invalid, or failed)."""
        self.metrics.request_failure.labels(self.model_name, str(status)).inc()
