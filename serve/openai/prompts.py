"""From a request body to a request on the engine: the model name checked, prompts tokenized and chat messages
rendered off the event loop, each prompt checked with the body's `SamplingParams` (once, here), and
submitted.

Text is measured before it is tokenized (`Frontend.check_text`), so that no prompt too long for the context
costs a tokenizer run; tokenizing and chat templates run on worker threads, off the event loop that streams
everyone's tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from draftsmith.errors import DraftsmithError
from draftsmith.serve.client.engine_client import QueueFullError, RequestOutputs
from draftsmith.serve.client.frontend import Frontend
from draftsmith.serve.engine.checks import CheckedRequest, PromptRefused
from draftsmith.serve.openai.http_errors import APIError
from draftsmith.serve.openai.messages import ChatMessage
from draftsmith.serve.openai.protocol import ChatCompletionRequest, CompletionRequest
from draftsmith.serve.openai.state import ServerState

T = TypeVar("T")


def check_model(state: ServerState, name: str) -> None:
    """A request naming another model than the one served is a 404."""
    if name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{state.model_name}`", "model")


async def off_loop(work: Callable[..., T], *args: Any, param: str = "prompt") -> T:
    """work(*args) on a worker thread (tokenizing, templates); its DraftsmithError is a 400 naming `param`."""
    try:
        return await asyncio.to_thread(work, *args)
    except DraftsmithError as exc:
        raise APIError(400, str(exc), param) from None


def encode_prompts(frontend: Frontend, prompts: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
    """Each prompt's text (None for token ids) and token ids; every text is measured before any is tokenized."""
    for index, p in enumerate(prompts):
        if isinstance(p, str):
            frontend.check_text(p, f"prompt {index}" if len(prompts) > 1 else "prompt")
    return [frontend.encode(p) if isinstance(p, str) else (None, list(p)) for p in prompts]


def render_chat(frontend: Frontend, messages: list[ChatMessage], tools: list | None = None) -> tuple[str, list[int]]:
    """The chat template's prompt (with `tools`, pydantic `Tool`s, where given) and its ids; more messages or
    text than the context holds is refused."""
    max_model_len = frontend.max_model_len
    if len(messages) > max_model_len:
        raise DraftsmithError(f"messages: {len(messages)} messages cannot fit max_model_len {max_model_len}")
    frontend.check_text("".join(m.text() for m in messages), "messages")
    prompt = frontend.apply_chat_template([m.for_template() for m in messages],
                                          [t.model_dump(exclude_none=True) for t in tools] if tools else None)
    return prompt, frontend.tokenizer(prompt, add_special_tokens=False).input_ids  # the template wrote them


def check_prompts(state: ServerState, body: CompletionRequest | ChatCompletionRequest,
                  encoded: list[tuple[str | None, list[int]]]) -> list[CheckedRequest]:
    """Each prompt with the body's sampling parameters, checked once, here (`engine.checks`): a 400 naming
    the prompt (which one, of a list) or the parameter that cannot run."""
    try:
        params = body.sampling_params(default_max_tokens=state.max_model_len)
    except DraftsmithError as exc:
        raise APIError(400, str(exc)) from None
    checked = []
    for index, (prompt, ids) in enumerate(encoded):
        try:
            checked.append(state.frontend.check(ids, params, prompt))
        except PromptRefused as exc:
            where = f"prompt {index}: " if len(encoded) > 1 else ""
            raise APIError(400, where + str(exc), "prompt") from None
        except DraftsmithError as exc:
            raise APIError(400, str(exc)) from None
    return checked


def submit(state: ServerState, request: CheckedRequest) -> RequestOutputs:
    """Queues a checked request: a full queue is a 503."""
    try:
        return state.engine.submit(request)
    except QueueFullError as exc:
        raise APIError(503, str(exc)) from None
