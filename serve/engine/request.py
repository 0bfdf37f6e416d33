"""One request's state inside the engine, and the outputs handed back to callers (vLLM's shapes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from draftsmith.serve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no cache slot yet
    RUNNING = "running"  # owns a slot; prefilling while num_computed < len(prompt)
    FINISHED = "finished"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", "abort", "error"
    stop_reason: int | str | None = None
    # per token: {token id: Logprob}, the token first (SamplingParams.logprobs set), else None
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # per prompt token: None for the first, then {token id: Logprob} (SamplingParams.prompt_logprobs set)
    prompt_logprobs: list[dict | None] | None = None
    # why the engine failed this request alone (finish reason "error"), naming the step phase; None otherwise
    error: str | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    text: str = ""  # detokenized output, kept current only when stop strings need it
    seed: int = 0  # with each token's position, keys its sampling noise
    logprobs: list[dict] | None = None  # per output token, when params.logprobs is set (`serve.engine.logprobs`)
    prompt_logprobs: list[dict | None] | None = None  # per prompt token read so far (params.prompt_logprobs)
    # n > 1: the group of samples this one belongs to, its place there, and until its prompt is in the cache,
    # the sibling whose prefill it shares (None: it prefills itself)
    group: RequestGroup | None = None
    index: int = 0
    leader: Request | None = None
    followers: list[Request] = field(default_factory=list)  # the siblings sharing this one's prefill
    error: str | None = None  # set with finish reason "error": what failed for this request (`row_faults`)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    @property
    def output_id(self) -> str:
        """The id its outputs go out under: the group's for one of n samples."""
        return self.group.request_id if self.group is not None else self.request_id

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.output_token_ids), self.finish_reason,
                                self.stop_reason, None if self.logprobs is None else list(self.logprobs))

    def to_output(self) -> RequestOutput:
        if self.group is not None:
            return self.group.to_output()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [self.completion()],
                             self.status is Status.FINISHED,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs), self.error)


@dataclass
class RequestGroup:
    """The n samples of one request (SamplingParams.n > 1): one request each, prefilled once. Its output holds
    every sample so far, by index (vLLM's cumulative output), and is finished when all are."""

    request_id: str
    members: list[Request]

    @property
    def finished(self) -> bool:
        return all(m.status is Status.FINISHED for m in self.members)

    def to_output(self) -> RequestOutput:
        first = self.members[0]
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids,
                             [m.completion() for m in self.members], self.finished,
                             None if first.prompt_logprobs is None else list(first.prompt_logprobs),
                             next((m.error for m in self.members if m.error is not None), None))
