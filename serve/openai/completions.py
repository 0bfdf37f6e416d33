"""POST /v1/completions: one prompt or a list of them (text or token ids), answered whole with a choice per
prompt and sample, or, for one prompt, streamed as `text_completion` events.

Every prompt is checked before any is queued, and a list of prompts succeeds or fails whole: when one cannot
be queued or fails, the others are aborted.
"""

from __future__ import annotations

import asyncio
import functools
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from draftsmith.serve.client.engine_client import RequestOutputs
from draftsmith.serve.engine.checks import CheckedRequest
from draftsmith.serve.engine.outputs import CompletionOutput, RequestOutput
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.openai.http_errors import GENERATION_RESPONSES, APIError
from draftsmith.serve.openai.outputs import collect, record_finished, token_text
from draftsmith.serve.openai.prompts import check_model, check_prompts, encode_prompts, off_loop, submit
from draftsmith.serve.openai.protocol import (
    CompletionRequest,
    completion_body,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    new_id,
)
from draftsmith.serve.openai.state import ServerState
from draftsmith.serve.openai.streaming import stream_events, usage_chunk_for

# A prompt's text (None when it came as token ids) and its token ids
Encoded = tuple[str | None, list[int]]
Submitted = tuple[SamplingParams, RequestOutputs]


def completions_router(state: ServerState) -> APIRouter:
    """/v1/completions: `n` samples of each prompt."""
    router = APIRouter()

    @router.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request):
        start = time.perf_counter()
        check_model(state, body.model)
        encoded = await off_loop(encode_prompts, state.frontend, body.prompts())
        checked = await off_loop(check_prompts, state, body, encoded)  # a grammar compiles here
        # what the engine reads: truncate_prompt_tokens may have cut a prompt (then its text is its ids')
        encoded = [(text if len(request.prompt_token_ids) == len(ids) else None, request.prompt_token_ids)
                   for (text, ids), request in zip(encoded, checked)]
        submitted = _submit_all(state, checked)
        rid = new_id("cmpl")
        if body.stream:  # one prompt (the body's validation)
            return _streamed(state, body, rid, encoded[0], submitted[0], start)
        return await _whole(state, body, raw, rid, encoded, submitted, start)

    return router


def _submit_all(state: ServerState, checked: list[CheckedRequest]) -> list[Submitted]:
    """Queues every prompt, or none: when the queue fills up part way, the prompts already queued are aborted."""
    submitted = []
    try:
        for request in checked:
            submitted.append((request.params, submit(state, request)))
    except APIError:
        for _, outputs in submitted:
            outputs.abort()
        raise
    return submitted


def _streamed(state: ServerState, body: CompletionRequest, rid: str, encoded: Encoded, submitted: Submitted,
              start: float) -> StreamingResponse:
    """The streamed answer to one prompt; with echo, each sample opens with the prompt (and its logprobs)."""
    (prompt, ids), (params, outputs) = encoded, submitted
    decode = functools.partial(token_text, state.frontend)
    offset = [0] * params.n  # text_offset runs on across a sample's chunks

    def chunk(index: int, delta: str, finish: str | None, entries: list[dict] | None) -> dict:
        logprobs = None
        if entries is not None:
            logprobs = completion_logprobs(entries, decode, offset[index])
            offset[index] += sum(map(len, logprobs["tokens"]))
        return completion_chunk(rid, state.model_name, delta, finish, logprobs, index)

    def echoed(out: RequestOutput, index: int) -> dict:
        entries = _echoed_entries(ids, out) if params.logprobs is not None else None
        return chunk(index, _prompt_text(state, prompt, ids), None, entries)

    usage = usage_chunk_for(state, body, rid, "text_completion", len(ids))
    events = stream_events(state, outputs, params, start, chunk, usage=usage, echo=echoed if body.echo else None)
    return StreamingResponse(events, media_type="text/event-stream")


async def _whole(state: ServerState, body: CompletionRequest, raw: Request, rid: str, encoded: list[Encoded],
                 submitted: list[Submitted], start: float) -> dict:
    """The whole answer: every prompt run to its end, then the choices in OpenAI's order, prompt by prompt and
    the samples of each."""
    tasks = [asyncio.ensure_future(collect(state, raw, outputs, start)) for _, outputs in submitted]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # one prompt failed or the client left: the others are aborted too
            task.cancel()
        raise
    choices = []
    for at, ((prompt, ids), out) in enumerate(zip(encoded, results)):
        record_finished(state, out, start)
        choices += [_choice(state, at * body.n + c.index, prompt, ids, out, c, body.echo) for c in out.outputs]
    return completion_body(rid, state.model_name, choices, sum(len(ids) for _, ids in encoded),
                           sum(len(c.token_ids) for out in results for c in out.outputs))


def _prompt_text(state: ServerState, prompt: str | None, ids: list[int]) -> str:
    """The prompt as text: as sent, or its token ids decoded."""
    return prompt if prompt is not None else state.frontend.tokenizer.decode(ids)


def _echoed_entries(ids: list[int], out: RequestOutput) -> list[dict]:
    """The prompt's logprob entries; its first token has no logprob."""
    return [{ids[0]: None}, *out.prompt_logprobs[1:]]


def _choice(state: ServerState, index: int, prompt: str | None, ids: list[int], out: RequestOutput,
            sample: CompletionOutput, echo: bool) -> dict:
    """One sample's choice; with echo, its text and logprobs start with the prompt's."""
    entries = sample.logprobs
    text = sample.text
    if echo:
        text = _prompt_text(state, prompt, ids) + text
        if entries is not None:
            entries = [*_echoed_entries(ids, out), *entries]
    logprobs = None if entries is None else completion_logprobs(entries, functools.partial(token_text, state.frontend))
    return completion_choice(index, text, sample.finish_reason, logprobs)
