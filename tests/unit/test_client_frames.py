"""The messages between an engine client and its engine loop: every kind survives the pipe's JSON exactly,
and a frame that is not one of them is refused, not half-read."""

from __future__ import annotations

import math
import multiprocessing

import pydantic
import pytest

from draftsmith.serve.client.frames import (
    COMMANDS,
    REPORTS,
    AbortRequest,
    AddFailed,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    StepFailed,
    StepReport,
    StopEngine,
    recv,
    send,
)
from draftsmith.serve.engine.logprobs import Logprob
from draftsmith.serve.engine.outputs import OutputDelta, RequestHeader, SampleDelta
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.engine.structured_outputs import StructuredOutputsParams

DELTA = OutputDelta(
    "req-1", False,
    [SampleDelta(0, [5, 6], [{5: Logprob(-0.123456789012345, 1), 9: Logprob(-math.inf, 2)}, {6: Logprob(-1e-300, 1)}],
                 None, None, None),
     SampleDelta(1, [], [], "done", "stop", 42)],
    RequestHeader("def f(", [1, 2], 2, [None, {2: Logprob(-3.5, 1)}]))

MESSAGES = [
    (COMMANDS, AddRequest("req-1", [1, 2, 3], SamplingParams(temperature=0.7, stop="x", n=2, seed=-5, logprobs=3), "hi")),
    (COMMANDS, AddRequest("req-3", [1], SamplingParams(
        logit_bias={5: -3.0}, bad_words=["x"], bad_words_token_ids=[[1, 2]], allowed_token_ids=[1, 2, 5],
        repetition_penalty=1.2, min_tokens=2, structured_outputs=StructuredOutputsParams(json={"type": "object"}),
        compiled_grammar="{}"))),
    (COMMANDS, AbortRequest("req-1")),
    (COMMANDS, StopEngine(2.5)),
    (REPORTS, StepReport([DELTA], EngineStats(1, 2, {"num_drafts": 3, "accepted_per_position": [2, 1]}))),
    (REPORTS, StepReport([])),
    (REPORTS, AddFailed("req-2", "prompt is empty", refused=True)),
    (REPORTS, StepFailed("engine error: boom")),
    (REPORTS, EngineReady(4, 512, 8192, 16)),
    (REPORTS, EngineFailed("no config.json")),
]


@pytest.mark.parametrize("adapter, message", MESSAGES, ids=[type(m).__name__ for _, m in MESSAGES])
def test_every_message_crosses_a_pipe_unchanged(adapter, message):
    ours, theirs = multiprocessing.Pipe()
    send(ours, adapter, message)
    received = recv(theirs, adapter)
    assert received == message and type(received) is type(message)


def test_logprob_keys_come_back_as_token_ids_and_minus_infinity_survives():
    received = REPORTS.validate_json(REPORTS.dump_json(StepReport([DELTA])))
    entries = received.deltas[0].samples[0].logprobs[0]
    assert list(entries) == [5, 9] and entries[9].logprob == -math.inf
    assert isinstance(entries[5], Logprob) and entries[5].logprob == -0.123456789012345


@pytest.mark.parametrize("frame", [
    b'{"kind": "add", "request_id": "r", "prompt_token_ids": [1], "params": {"temperature": -1}}',  # its own checks
    b'{"kind": "add", "request_id": "r", "prompt_token_ids": "1 2", "params": {}}',
    b'{"kind": "launch", "request_id": "r"}',
    b'["add", "r", [1], {}, null]',  # a positional list
])
def test_a_frame_that_is_no_command_is_refused(frame):
    with pytest.raises(pydantic.ValidationError):
        COMMANDS.validate_json(frame)
