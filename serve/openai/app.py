"""OpenAI-compatible HTTP server (FastAPI) over the shared engine loop. Handlers stay thin: validate the
body with pydantic, turn it into token ids and `SamplingParams`, and relay the engine's outputs.

No request can stall the others: bodies and keys are checked before a handler runs (`http_limits`), text
that cannot fit the context is refused untokenized (`Frontend.check_text`), and tokenizing, chat templates
and detokenizing whole sequences run on worker threads, off the event loop that streams everyone's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftsmith import __version__
from draftsmith.errors import DraftsmithError, format_validation_error
from draftsmith.serve.client.async_engine import AsyncEngine, QueueFullError, RequestRejected
from draftsmith.serve.client.output_streams import DEFAULT_MAX_BACKLOG, BacklogFull
from draftsmith.serve.engine.detokenizer import IncrementalText, token_bytes
from draftsmith.serve.engine.request import RequestOutput
from draftsmith.serve.openai.http_limits import DEFAULT_MAX_BODY_BYTES, EdgeLimits
from draftsmith.serve.openai.metrics import ServerMetrics
from draftsmith.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
    chat_body,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    error_body,
    new_id,
    usage_chunk,
)

logger = logging.getLogger("draftsmith")


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


def error_status(exc: BaseException) -> int:
    """The HTTP status of a request's failure: refused by the engine or cut off for not reading 400, the server
    unavailable 503, else 500."""
    if isinstance(exc, (RequestRejected, BacklogFull)):
        return 400
    return 503 if isinstance(exc, DraftsmithError) else 500


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


# What /openapi.json says each route may answer besides 200: every status the server returns, in OpenAI's
# error body (a bad body is 400 here, as in OpenAI's API, never FastAPI's 422)
def _errors(*statuses: int) -> dict:
    why = {400: "invalid request (the message names the field)", 401: "missing or wrong API key (--api-key)",
           404: "no such model", 413: "request body over --max-body-bytes",
           499: "the client disconnected before the answer",
           500: "the engine failed while running the request (the message says why)",
           503: "queue full (--max-queue), engine restarting or stopped, or the server shutting down"}
    return {status: {"model": ErrorResponse, "description": why[status]} for status in statuses}


_GENERATION = {200: {"description": "the answer; with stream=true, server-sent events ending in `data: [DONE]`",
                     "content": {"text/event-stream": {"schema": {"type": "string"}}}},
               **_errors(400, 401, 404, 413, 499, 500, 503)}


def build_app(engine: AsyncEngine, served_model_name: str, options: ServerOptions | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    options = options or ServerOptions()
    llm = engine.frontend  # the tokenizer, chat template and prompt checks (no weights in the API process)
    max_model_len = llm.max_model_len
    metrics = metrics or ServerMetrics(served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        yield
        # uvicorn has stopped taking connections and waited for open ones; finish or cancel the rest.
        await asyncio.to_thread(engine.shutdown, options.shutdown_timeout)

    app = FastAPI(title="draftsmith", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.options = engine, options
    # SIGTERM (`serve_cli`): requests still running after --shutdown-timeout end with an error while their
    # connections are open
    app.state.begin_shutdown = lambda: engine.begin_shutdown(options.shutdown_timeout)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)  # validation errors answer 400
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    public = frozenset({"/health", "/metrics"} if options.public_metrics else {"/health"})
    app.add_middleware(EdgeLimits, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                       public_paths=public,
                       on_refused=lambda status: metrics.request_failure.labels(served_model_name, str(status)).inc())

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        message = format_validation_error(exc, skip_loc=("body",), whole="")
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        metrics.request_failure.labels(served_model_name, "400").inc()
        return _error(400, message, param)

    @app.exception_handler(APIError)
    async def on_api_error(_request: Request, exc: APIError):
        metrics.request_failure.labels(served_model_name, str(exc.status)).inc()
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health", responses={200: {"description": "the engine is stepping",
                                         "content": {"application/json": {"example": {"status": "ok"}}}},
                                   **_errors(503)})
    async def health():
        if not engine.healthy:
            return _error(503, f"the engine is not running: {engine.unavailable_reason()}")
        return {"status": "ok"}

    @app.get("/version", responses=_errors(401))
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401)})
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_errors(401))
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "draftsmith", "root": str(llm.model_dir),
                                            "max_model_len": max_model_len}]}

    def decode_token(token: int) -> str:
        return llm.tokenizer.decode([token])

    def encode_token(token: int) -> bytes:
        return token_bytes(llm.tokenizer, token)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{served_model_name}`",
                           "model")

    def submit(ids: list[int], body, prompt: str | None):
        try:
            params = body.sampling_params(default_max_tokens=max_model_len)
            return params, engine.submit(ids, params, prompt)
        except QueueFullError as exc:
            raise APIError(503, str(exc)) from None
        except DraftsmithError as exc:
            raise APIError(400, str(exc), "prompt" if "prompt" in str(exc) else None) from None

    async def off_loop(work, *args, param: str = "prompt"):
        """work(*args) on a worker thread (tokenizing, templates); its DraftsmithError is a 400 naming `param`."""
        try:
            return await asyncio.to_thread(work, *args)
        except DraftsmithError as exc:
            raise APIError(400, str(exc), param) from None

    def encode_prompts(prompts: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
        for index, p in enumerate(prompts):  # all checked before any is tokenized
            if isinstance(p, str):
                llm.check_text(p, f"prompt {index}" if len(prompts) > 1 else "prompt")
        return [llm.encode(p) if isinstance(p, str) else (None, list(p)) for p in prompts]

    def render_chat(messages: list) -> tuple[str, list[int]]:
        """The chat template's prompt and its ids; more messages or text than the context holds is refused."""
        if len(messages) > max_model_len:
            raise DraftsmithError(f"messages: {len(messages)} messages cannot fit max_model_len {max_model_len}")
        llm.check_text("".join(m.content for m in messages), "messages")
        prompt = llm.apply_chat_template([m.model_dump() for m in messages])
        return prompt, llm.tokenizer(prompt, add_special_tokens=False).input_ids  # the template wrote them

    async def collect(raw: Request, outputs: AsyncIterator[RequestOutput], start: float) -> RequestOutput:
        """Runs a non-streamed request to the end; a client that disconnects cancels it."""
        async def consume():
            last, first_at = None, None
            async for last in outputs:  # noqa: B007
                if first_at is None and any(c.token_ids for c in last.outputs):
                    first_at = time.perf_counter()
                    metrics.ttft.labels(served_model_name).observe(first_at - start)
            return last

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await raw.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    await outputs.aclose()
                    raise APIError(499, "client disconnected")
        except asyncio.CancelledError:  # cancelled from outside: cancelling the consumer aborts the request
            task.cancel()
            raise
        try:
            return task.result()
        except (DraftsmithError, RuntimeError) as exc:
            raise APIError(error_status(exc), str(exc)) from None

    def finished(output: RequestOutput, start: float) -> None:
        metrics.e2e.labels(served_model_name).observe(time.perf_counter() - start)
        metrics.request_success.labels(served_model_name, output.outputs[0].finish_reason or "stop").inc()

    async def stream_events(outputs, params, start, make_chunk, first_chunks, include_usage, rid, obj, n_prompt,
                            echo=None):
        """Server-sent chunks of the request's `params.n` samples, each chunk one sample's (`make_chunk(index,
        delta, finish, logprob entries)`), a sample's last one with its finish reason. `echo(output, index)`: a
        chunk per sample sent once the first output is in (the prompt, which it scored), or None."""
        texts = [IncrementalText(llm.tokenizer, params.stop) for _ in range(params.n)]
        n_logged = [0] * params.n  # per sample, tokens whose logprobs went out
        ended = [False] * params.n
        last_at, n_tokens = None, 0
        try:
            for chunk in first_chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            async for out in outputs:
                if echo is not None:
                    for index in range(params.n):
                        yield f"data: {json.dumps(echo(out, index))}\n\n"
                    echo = None
                now = time.perf_counter()
                total = sum(len(c.token_ids) for c in out.outputs)
                if total > n_tokens:
                    if last_at is None:
                        metrics.ttft.labels(served_model_name).observe(now - start)
                    else:
                        metrics.itl.labels(served_model_name).observe((now - last_at) / (total - n_tokens))
                    last_at, n_tokens = now, total
                for c in out.outputs:
                    if ended[c.index]:
                        continue
                    ended[c.index] = done = c.finish_reason is not None
                    delta = texts[c.index].delta(c.token_ids, done, c.text if done else None)
                    if delta or done:
                        # the logprobs of every token since the sample's last chunk: a token whose text is held
                        # back (half a character, a possible stop string) has its logprob sent with the text
                        # that follows
                        entries = c.logprobs[n_logged[c.index]:] if c.logprobs is not None else None
                        n_logged[c.index] = len(c.token_ids)
                        chunk = make_chunk(c.index, delta, c.finish_reason if done else None, entries)
                        yield f"data: {json.dumps(chunk)}\n\n"
                if out.finished:
                    finished(out, start)
                    if include_usage:
                        yield f"data: {json.dumps(usage_chunk(rid, served_model_name, obj, n_prompt, n_tokens))}\n\n"
        except (DraftsmithError, RuntimeError) as exc:
            yield f"data: {json.dumps(error_body(str(exc), error_status(exc)))}\n\n"
        finally:  # the client left, or the stream was cancelled: the request goes too (a no-op once it ended)
            outputs.abort()
        yield "data: [DONE]\n\n"

    def tokenize_prompt(text: str, add_special_tokens: bool) -> list[int]:
        llm.check_text(text)
        return llm.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        if body.messages is not None:
            _, ids = await off_loop(render_chat, body.messages, param="messages")
        else:
            ids = await off_loop(tokenize_prompt, body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        vocab = llm.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be below the vocabulary size {vocab}", "tokens")
        if len(body.tokens) > max_model_len:
            raise APIError(400, f"tokens: {len(body.tokens)} ids, more than max_model_len {max_model_len}", "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(llm.tokenizer.decode, body.tokens))

    @app.post("/v1/completions", responses=_GENERATION)
    async def completions(body: CompletionRequest, raw: Request):
        start = time.perf_counter()
        check_model(body.model)
        encoded = await off_loop(encode_prompts, body.prompts())
        for index, (_, ids) in enumerate(encoded):  # all checked before any is queued
            try:
                llm.check_prompt(ids)
            except DraftsmithError as exc:
                where = f"prompt {index}: " if len(encoded) > 1 else ""
                raise APIError(400, where + str(exc), "prompt") from None
        submitted = []
        try:
            for prompt, ids in encoded:
                submitted.append(submit(ids, body, prompt))
        except APIError:  # the queue filled up part way: the prompts already queued go too
            for _, outputs in submitted:
                outputs.abort()
            raise
        rid = new_id("cmpl")
        if body.stream:  # one prompt (the body's validation)
            (_, ids), (params, outputs) = encoded[0], submitted[0]
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            offset = [0] * params.n  # text_offset runs on across a sample's chunks

            def chunk(index, delta, finish, entries):
                logprobs = None
                if entries is not None:
                    logprobs = completion_logprobs(entries, decode_token, offset[index])
                    offset[index] += sum(map(len, logprobs["tokens"]))
                return completion_chunk(rid, served_model_name, delta, finish, logprobs, index)

            def echoed(out: RequestOutput, index: int) -> dict:
                entries = _echoed_entries(ids, out) if params.logprobs is not None else None
                return chunk(index, prompt_text(encoded[0][0], ids), None, entries)

            events = stream_events(outputs, params, start, chunk, [], include_usage, rid, "text_completion", len(ids),
                                   echoed if body.echo else None)
            return StreamingResponse(events, media_type="text/event-stream")
        tasks = [asyncio.ensure_future(collect(raw, outputs, start)) for _, outputs in submitted]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one prompt failed or the client left: the others are aborted too
                task.cancel()
            raise
        choices = []  # OpenAI's order: prompt by prompt, the samples of each
        for at, ((prompt, ids), out) in enumerate(zip(encoded, results)):
            finished(out, start)
            choices += [_completion_choice(at * body.n + c.index, prompt, ids, out, c, body.echo) for c in out.outputs]
        return completion_body(rid, served_model_name, choices, sum(len(ids) for _, ids in encoded),
                               sum(len(c.token_ids) for out in results for c in out.outputs))

    def prompt_text(prompt: str | None, ids: list[int]) -> str:
        return prompt if prompt is not None else llm.tokenizer.decode(ids)

    def _echoed_entries(ids: list[int], out: RequestOutput) -> list[dict]:
        return [{ids[0]: None}, *out.prompt_logprobs[1:]]  # the prompt's first token has no logprob

    def _completion_choice(index: int, prompt: str | None, ids: list[int], out: RequestOutput, c, echo: bool) -> dict:
        entries = c.logprobs
        text = c.text
        if echo:
            text = prompt_text(prompt, ids) + text
            if entries is not None:
                entries = [*_echoed_entries(ids, out), *entries]
        logprobs = None if entries is None else completion_logprobs(entries, decode_token)
        return completion_choice(index, text, c.finish_reason, logprobs)

    @app.post("/v1/chat/completions", responses=_GENERATION)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        start = time.perf_counter()
        check_model(body.model)
        prompt, ids = await off_loop(render_chat, body.messages, param="messages")
        params, outputs = submit(ids, body, prompt)
        rid = new_id("chatcmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            first = [chat_chunk(rid, served_model_name, {"role": "assistant", "content": ""}, None, None, index)
                     for index in range(params.n)]

            def chunk(index, delta, finish, entries):
                logprobs = None if entries is None else chat_logprobs(entries, decode_token, params.logprobs, encode_token)
                return chat_chunk(rid, served_model_name, {"content": delta} if delta else {}, finish, logprobs, index)

            events = stream_events(outputs, params, start, chunk, first, include_usage, rid, "chat.completion.chunk",
                                   len(ids))
            return StreamingResponse(events, media_type="text/event-stream")
        out = await collect(raw, outputs, start)
        finished(out, start)
        choices = [chat_choice(c.index, c.text, c.finish_reason, None if c.logprobs is None else
                               chat_logprobs(c.logprobs, decode_token, params.logprobs, encode_token))
                   for c in out.outputs]
        return chat_body(rid, served_model_name, choices, len(ids), sum(len(c.token_ids) for c in out.outputs))

    return app
