"""What an engine client and its engine loop say to each other: typed messages, one dataclass each.

On a thread they pass as objects; between processes they go as length-prefixed frames (`send_bytes`) of
JSON, validated on arrival by pydantic against the same dataclasses (never pickle, so a frame can only ever
be data). Commands go to the loop; reports come back: per step, each moved request's `OutputDelta`, and the
engine's counters for the Prometheus gauges when they are due.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, TypeAdapter

from draftsmith.serve.engine.outputs import OutputDelta
from draftsmith.serve.engine.sampling_params import SamplingParams


# ------------------------------------------------------------------------------------- client -> loop
@dataclass
class AddRequest:
    """A request checked at the edge (`engine.checks`), for the engine to queue under the client's id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    kind: Literal["add"] = "add"


@dataclass
class AbortRequest:
    request_id: str
    kind: Literal["abort"] = "abort"


@dataclass
class StopEngine:
    """Stop once nothing is in flight, or `grace_s` from now at the latest."""

    grace_s: float
    kind: Literal["stop"] = "stop"


Command = Annotated[Union[AddRequest, AbortRequest, StopEngine], Field(discriminator="kind")]  # noqa: UP007


# ------------------------------------------------------------------------------------- loop -> client
@dataclass
class EngineStats:
    running: int
    waiting: int
    metrics: dict[str, Any]  # the engine's cumulative `get_metrics()`


@dataclass
class StepReport:
    deltas: list[OutputDelta]  # one per request that moved (none when the engine just went idle)
    stats: EngineStats | None = None  # when due (every STATS_EVERY_S, and on going idle)
    kind: Literal["step"] = "step"


@dataclass
class AddFailed:
    """The engine would not take a request (`refused`: its own mistake, a 400) or failed adding it (500)."""

    request_id: str
    message: str
    refused: bool
    kind: Literal["add_failed"] = "add_failed"


@dataclass
class StepFailed:
    """A step raised (an engine fault): every request in flight failed with it."""

    message: str
    kind: Literal["step_failed"] = "step_failed"


@dataclass
class EngineReady:
    """An engine process loaded its model: what the client's frontend needs of it."""

    num_speculative_tokens: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    gate: str = ""  # the acceptance gate's passing line, where the engine process ran it
    kind: Literal["ready"] = "ready"


@dataclass
class EngineFailed:
    """An engine process could not load its model (a bad folder or speculative config)."""

    message: str
    kind: Literal["failed"] = "failed"


Report = Annotated[Union[StepReport, AddFailed, StepFailed, EngineReady, EngineFailed],  # noqa: UP007
                   Field(discriminator="kind")]

# -inf logprobs (tokens a filter removed) go as JSON's -Infinity, as Python's json module writes them
_JSON = ConfigDict(ser_json_inf_nan="constants")
COMMANDS: TypeAdapter[Command] = TypeAdapter(Command, config=_JSON)
REPORTS: TypeAdapter[Report] = TypeAdapter(Report, config=_JSON)


def send(conn, adapter: TypeAdapter, message) -> None:
    conn.send_bytes(adapter.dump_json(message))


def recv(conn, adapter: TypeAdapter):
    return adapter.validate_json(conn.recv_bytes())
