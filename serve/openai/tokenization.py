"""POST /tokenize and POST /detokenize (vLLM's): a prompt or chat messages to token ids, and ids back to text,
with the served model's tokenizer, off the event loop."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from draftsmith.serve.client.frontend import Frontend
from draftsmith.serve.openai.http_errors import APIError, documented_errors
from draftsmith.serve.openai.prompts import check_model, off_loop, render_chat
from draftsmith.serve.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from draftsmith.serve.openai.state import ServerState


def tokenize_prompt(frontend: Frontend, text: str, add_special_tokens: bool) -> list[int]:
    """The token ids of `text`, which is refused untokenized when it cannot fit the context."""
    frontend.check_text(text)
    return frontend.tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def tokenize_router(state: ServerState) -> APIRouter:
    """/tokenize: a prompt's ids, or those of chat messages rendered with the chat template; /detokenize: ids
    (below the vocabulary size, at most max_model_len of them) back to text."""
    router = APIRouter()
    frontend = state.frontend

    @router.post("/tokenize", response_model=TokenizeResponse, responses=documented_errors(400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            check_model(state, body.model)
        if body.messages is not None:
            _, ids = await off_loop(render_chat, frontend, body.messages, param="messages")
        else:
            ids = await off_loop(tokenize_prompt, frontend, body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=documented_errors(400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            check_model(state, body.model)
        vocab, max_model_len = frontend.vocab_size, state.max_model_len
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be below the vocabulary size {vocab}", "tokens")
        if len(body.tokens) > max_model_len:
            raise APIError(400, f"tokens: {len(body.tokens)} ids, more than max_model_len {max_model_len}", "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(frontend.tokenizer.decode, body.tokens))

    return router
