"""OpenAI request bodies (pydantic) and response builders for /v1/completions and /v1/chat/completions.

Unknown fields are ignored with a warning, as vLLM does, because OpenAI clients add fields over time;
known fields are validated and a bad one is a 400 naming it. Every number is bounded (vLLM's bounds or
tighter: seeds in int64, token ids in int64 and then below the vocabulary, counts of stop strings and
token ids), and every string anywhere in a body, unknown fields included, must be valid Unicode (JSON can
carry a lone UTF-16 surrogate, which no tokenizer or response can encode).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from draftsmith.errors import DraftsmithError
from draftsmith.serve.engine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    SamplingParams,
)
from draftsmith.serve.engine.structured_outputs import StructuredOutputsParams, response_format_constraint
from draftsmith.serve.openai.messages import ChatMessage
from draftsmith.serve.openai.tools import Tool, ToolChoice, resolve_tool_choice, tool_constraint

logger = logging.getLogger("draftsmith")

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")


def invalid_unicode_at(value: Any) -> str | None:
    """The dotted path of the first string in `value` (parsed JSON) holding a lone UTF-16 surrogate, or None;
    iterative, so that no nesting depth overflows the stack."""
    todo = [((), value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str) and _SURROGATE.search(item):
            return ".".join(map(str, path)) or "body"
        if isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return ".".join(map(str, path)) or "body"
                todo.append(((*path, key), child))
        elif isinstance(item, list):
            todo.extend(((*path, i), child) for i, child in enumerate(item))
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = invalid_unicode_at(data)
        if where is not None:
            raise ValueError(f"{where}: not valid Unicode (a lone UTF-16 surrogate)")
        return data

    @model_validator(mode="after")
    def _warn_unknown(self):
        if self.model_extra:
            for name, value in self.model_extra.items():
                if name in UNSUPPORTED and value not in UNSUPPORTED[name][0]:
                    raise ValueError(f"{name}: {UNSUPPORTED[name][1]}")
            logger.warning("ignoring unknown request fields: %s", sorted(self.model_extra))
        return self


# Fields OpenAI or vLLM define that would change the answer and that draftsmith does not serve: a value other
# than the harmless ones listed is a 400 naming the field, never a 200 that ignores what was asked.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "needs beam search, which is not supported"),
    "include_stop_str_in_output": ((None, False), "not supported: stop strings are left out of the output"),
    "skip_special_tokens": ((None, True), "not supported: special tokens are always skipped in text"),
    "spaces_between_special_tokens": ((None, True), "not supported"),
    "prompt_logprobs": ((None,), "not supported here: completions' echo with logprobs gives the prompt's"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((None, False), "not supported"),
    "echo": ((None, False), "chat does not echo the prompt (completions do)"),
    "add_generation_prompt": ((None, True), "the chat template always gets the generation prompt"),
    "continue_final_message": ((None, False), "continuing the final message is not supported"),
    "chat_template": ((None,), "the model's own chat template is used; another is not supported"),
    "chat_template_kwargs": ((None, {}), "not supported"),
    "documents": ((None, []), "documents for the chat template are not supported"),
    "functions": ((None, []), "the legacy function-calling fields are not supported: use tools"),
    "function_call": ((None, "none"), "the legacy function-calling fields are not supported: use tool_choice"),
    "suffix": ((None, ""), "insertion (a suffix) is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
    "structural_tag": ((None,), "structural tags are not supported: use structured_outputs or tools"),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs json_schema")
        return self


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, description="at most the context; larger is the context")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0: off; the vocabulary size or more is off too")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(default=1, ge=1, description="samples of each prompt, one choice each; all share one prefill")
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    best_of: int | None = Field(default=None, ge=1, description="only best_of=n is supported")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: Annotated[dict[TokenId, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        default=None, description="token id -> bias added to its logit, -100..100")
    min_tokens: int = Field(default=0, ge=0, description="EOS and stop_token_ids are held back until this many")
    bad_words: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=2**20)] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX, description=(
        "keep the prompt's last N tokens; -1: as many as the context takes"))
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(default=None, description=(
        "vLLM's: exactly one of json, regex, choice, grammar, json_object"))
    guided_json: dict | str | None = Field(default=None, description="older spelling of structured_outputs.json")
    guided_regex: str | None = Field(default=None, description="older spelling of structured_outputs.regex")
    guided_choice: list[str] | None = Field(default=None, description="older spelling of structured_outputs.choice")
    guided_grammar: str | None = Field(default=None, description="older spelling of structured_outputs.grammar")
    guided_whitespace_pattern: str | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint the body asks for, whichever spelling (a 400 where it asks for two)."""
        asked = {name: spec for name, spec in self._spelled_constraints() if spec is not None}
        if len(asked) > 1:
            raise DraftsmithError(f"{', '.join(asked)}: give one output constraint, not two")
        return next(iter(asked.values()), None)

    def _spelled_constraints(self):
        """(spelling, the constraint it asks for or None) for each way a body can ask for one."""
        if self.response_format is not None:
            yield "response_format", response_format_constraint(self.response_format.model_dump(by_alias=True))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            yield "structured_outputs", StructuredOutputsParams(**fields)
        guided = {kind: getattr(self, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
        guided = {kind: value for kind, value in guided.items() if value is not None}
        if guided:
            yield "guided_*", StructuredOutputsParams(**guided, whitespace_pattern=self.guided_whitespace_pattern)

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: only best_of=n is supported (no server-side reranking of samples)")
        return self

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=min(self.max_tokens or default_max_tokens, default_max_tokens), stop=self.stop,
                              stop_token_ids=self.stop_token_ids or [], seed=self.seed, ignore_eos=self.ignore_eos,
                              logprobs=self.top_alternatives(), n=self.n, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_p=self.min_p, logit_bias=self.logit_bias, min_tokens=self.min_tokens,
                              bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
                              truncate_prompt_tokens=self.truncate_prompt_tokens,
                              structured_outputs=self.constraint())

    def top_alternatives(self) -> int | None:
        """How many top alternatives per token the response reports logprobs for (None: no logprobs)."""
        return None


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Sampling):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenIds], Field(
        min_length=1)] = Field(description=(
        "text or token ids; or a list of those, answered by one choice each, in order (not streamed)"))
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description=(
        "report each generated token's logprob and those of this many most likely tokens at its position"))
    echo: bool = Field(default=False, description=(
        "return the prompt before the completion, and with logprobs the prompt tokens' logprobs too"))

    def top_alternatives(self) -> int | None:
        return self.logprobs

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        params = super().sampling_params(default_max_tokens)
        if self.echo:
            params.prompt_logprobs = self.logprobs
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request holds: one, or each of a list."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @model_validator(mode="after")
    def _one_prompt_when_streamed(self):  # (empty prompts: the field's min_length)
        if self.stream and len(self.prompts()) > 1:
            raise ValueError("prompt: a list of prompts is answered whole; stream one prompt per request")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = Field(default=None, description=(
        "'auto' (text, or calls in the Hermes format), 'none', 'required' or a named function"))
    parallel_tool_calls: bool | None = Field(default=None, description="false: 'required' makes one call")

    def tool_choice_in_force(self) -> ToolChoice | None:
        """The tool choice that shapes the answer (None: text); DraftsmithError where it cannot be served."""
        return resolve_tool_choice(self.tools, self.tool_choice)

    def constraint(self) -> StructuredOutputsParams | None:
        asked = super().constraint()
        choice = self.tool_choice_in_force()
        calls = tool_constraint(self.tools, choice, self.parallel_tool_calls is not False) if choice else None
        if calls is not None and asked is not None:
            raise DraftsmithError("tool_choice: a tool call is written under its own schema; drop response_format "
                                  "and structured_outputs, or tool_choice")
        return calls or asked

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def top_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, choices: list[dict], prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_chunk(rid: str, model: str, text: str, finish: str | None,
                     logprobs: dict | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None,
                calls: list[dict] | None = None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text} if calls is None else {
        "role": "assistant", "content": None, "tool_calls": calls}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_body(rid: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None,
               logprobs: dict | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


# Engine logprob entries ({token id: Logprob}, the generated token first) in OpenAI's two shapes; `decode`
# turns one token id into its text.
def completion_logprobs(entries: list[dict], decode, text_offset: int = 0) -> dict[str, list]:
    """The legacy completions shape: parallel lists, and per token a {text: logprob} of it and the top ones."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        token, chosen = next(iter(entry.items()))  # None: an echoed prompt's first token, which has no logprob
        text = decode(token)
        tokens.append(text)
        token_logprobs.append(None if chosen is None else chosen.logprob)
        top.append(None if chosen is None else {decode(t): lp.logprob for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: list[dict], decode, top_n: int, to_bytes) -> dict[str, list]:
    """The chat shape: per token its text, logprob and bytes (`to_bytes`: a token id's, exact where the text is
    part of a character), and the top_n most likely tokens there."""
    def item(token: int, logprob: float) -> dict[str, Any]:
        return {"token": decode(token), "logprob": logprob, "bytes": list(to_bytes(token))}

    content = []
    for entry in entries:
        token, chosen = next(iter(entry.items()))
        ranked = sorted(entry.items(), key=lambda pair: pair[1].rank)[:top_n]
        content.append({**item(token, chosen.logprob), "top_logprobs": [item(t, lp.logprob) for t, lp in ranked]})
    return {"content": content}


def usage_chunk(rid: str, model: str, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every 4xx/5xx answer carries."""

    error: ErrorInfo


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
