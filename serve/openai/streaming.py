"""A streamed answer: the engine's outputs as server-sent events, one JSON chunk per `data:` event, ending in
`data: [DONE]`.

Each chunk carries one sample's new text; a sample's last chunk carries its finish reason. A failure after the
stream began cannot change the status any more, so it goes out as an error event before `[DONE]`.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable

from draftsmith.errors import DraftsmithError
from draftsmith.serve.client.engine_client import RequestOutputs
from draftsmith.serve.engine.detokenizer import IncrementalText
from draftsmith.serve.engine.outputs import RequestOutput
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.openai.http_errors import error_status
from draftsmith.serve.openai.outputs import record_finished
from draftsmith.serve.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body, usage_chunk
from draftsmith.serve.openai.state import ServerState

# make_chunk(sample index, new text, finish reason or None, logprob entries of the new tokens or None)
MakeChunk = Callable[[int, str, str | None, list[dict] | None], dict]

DONE = "data: [DONE]\n\n"


def event(chunk: dict) -> str:
    """One server-sent event carrying `chunk`."""
    return f"data: {json.dumps(chunk)}\n\n"


def usage_chunk_for(state: ServerState, body: CompletionRequest | ChatCompletionRequest, rid: str, obj: str,
                    n_prompt: int) -> Callable[[int], dict] | None:
    """A stream's usage chunk for its number of generated tokens, when the client asked for one
    (`stream_options.include_usage`); else None."""
    if not (body.stream_options and body.stream_options.include_usage):
        return None
    return functools.partial(usage_chunk, rid, state.model_name, obj, n_prompt)


async def stream_events(state: ServerState, outputs: RequestOutputs, params: SamplingParams, start: float,
                        make_chunk: MakeChunk, *, first_chunks: Iterable[dict] = (),
                        usage: Callable[[int], dict] | None = None,
                        echo: Callable[[RequestOutput, int], dict] | None = None) -> AsyncIterator[str]:
    """Server-sent chunks of the request's `params.n` samples (`make_chunk`), after `first_chunks`.

    Args:
        usage: the usage chunk for the number of generated tokens, sent once the request finished; None when
            the client did not ask for it.
        echo: echo(output, index) is a chunk per sample sent once the first output is in (the prompt, which
            that output scored); None for no echo.
    """
    texts = [IncrementalText(state.frontend.tokenizer, params.stop) for _ in range(params.n)]
    n_logged = [0] * params.n  # per sample, tokens whose logprobs went out
    ended = [False] * params.n
    last_at, n_tokens = None, 0
    try:
        for chunk in first_chunks:
            yield event(chunk)
        async for out in outputs:
            if echo is not None:
                for index in range(params.n):
                    yield event(echo(out, index))
                echo = None
            now = time.perf_counter()
            total = sum(len(c.token_ids) for c in out.outputs)
            if total > n_tokens:
                if last_at is None:
                    state.metrics.ttft.labels(state.model_name).observe(now - start)
                else:
                    state.metrics.itl.labels(state.model_name).observe((now - last_at) / (total - n_tokens))
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
                    yield event(make_chunk(c.index, delta, c.finish_reason if done else None, entries))
            if out.finished:
                record_finished(state, out, start)
                if usage is not None:
                    yield event(usage(n_tokens))
    except (DraftsmithError, RuntimeError) as exc:
        yield event(error_body(str(exc), error_status(exc)))
    finally:  # the client left, or the stream was cancelled: the request goes too (a no-op once it ended)
        outputs.abort()
    yield DONE
