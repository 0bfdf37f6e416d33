"""POST /v1/chat/completions: chat messages rendered with the model's chat template, answered whole or streamed
as `chat.completion.chunk` events."""

from __future__ import annotations

import functools
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from draftsmith.serve.client.engine_client import RequestOutputs
from draftsmith.serve.engine.detokenizer import token_bytes
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.openai.http_errors import GENERATION_RESPONSES
from draftsmith.serve.openai.outputs import collect, record_finished, token_text
from draftsmith.serve.openai.prompts import check_model, check_prompts, off_loop, render_chat, submit
from draftsmith.serve.openai.protocol import (
    ChatCompletionRequest,
    chat_body,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    new_id,
)
from draftsmith.serve.openai.state import ServerState
from draftsmith.serve.openai.streaming import stream_events, usage_chunk_for
from draftsmith.serve.openai.tools import ToolCallDeltas, finish_reason, tool_calls


def chat_router(state: ServerState) -> APIRouter:
    """/v1/chat/completions: one prompt, from the messages, and `n` samples of it."""
    router = APIRouter()

    @router.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        start = time.perf_counter()
        check_model(state, body.model)
        prompt, ids = await off_loop(render_chat, state.frontend, body.messages, body.tools, param="messages")
        [request] = await off_loop(check_prompts, state, body, [(prompt, ids)])  # a grammar compiles here
        ids = request.prompt_token_ids  # truncate_prompt_tokens may have cut it
        params, outputs = request.params, submit(state, request)
        rid = new_id("chatcmpl")
        calling = body.tool_choice_in_force() not in (None, "none")
        if body.stream:
            return _streamed(state, body, rid, len(ids), params, outputs, start)
        out = await collect(state, raw, outputs, start)
        record_finished(state, out, start)
        choices = []
        for c in out.outputs:
            logprobs = None if c.logprobs is None else _logprobs(state, c.logprobs, params)
            calls = tool_calls(c.text, body.tool_choice_in_force()) if calling else None
            finish = finish_reason(body.tool_choice_in_force(), c.finish_reason) if calls else c.finish_reason
            choices.append(chat_choice(c.index, c.text, finish, logprobs, calls))
        return chat_body(rid, state.model_name, choices, len(ids), sum(len(c.token_ids) for c in out.outputs))

    return router


def _logprobs(state: ServerState, entries: list[dict], params: SamplingParams) -> dict:
    """Engine logprob entries in the chat shape, with the `params.logprobs` top alternatives of each token."""
    return chat_logprobs(entries, functools.partial(token_text, state.frontend), params.logprobs,
                         functools.partial(token_bytes, state.frontend.tokenizer))


def _streamed(state: ServerState, body: ChatCompletionRequest, rid: str, n_prompt: int, params: SamplingParams,
              outputs: RequestOutputs, start: float) -> StreamingResponse:
    """The streamed answer: each sample opens with the assistant's role, then its text as it comes."""
    first = [chat_chunk(rid, state.model_name, {"role": "assistant", "content": ""}, None, None, index)
             for index in range(params.n)]

    choice = body.tool_choice_in_force()
    calls = [ToolCallDeltas(choice) for _ in range(params.n)] if choice not in (None, "none") else None

    def chunk(index: int, delta: str, finish: str | None, entries: list[dict] | None) -> dict:
        logprobs = None if entries is None else _logprobs(state, entries, params)
        if calls is None:
            return chat_chunk(rid, state.model_name, {"content": delta} if delta else {}, finish, logprobs, index)
        message = calls[index].delta(delta, finish is not None)
        if "tool_calls" in message and finish is not None:
            finish = finish_reason(choice, finish)
        return chat_chunk(rid, state.model_name, message, finish, logprobs, index)

    usage = usage_chunk_for(state, body, rid, "chat.completion.chunk", n_prompt)
    events = stream_events(state, outputs, params, start, chunk, first_chunks=first, usage=usage)
    return StreamingResponse(events, media_type="text/event-stream")
