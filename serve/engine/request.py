"""One request's state inside the engine, and what it reports of itself each step (`outputs`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from draftsmith.serve.engine.outputs import OutputDelta, RequestHeader, SampleDelta
from draftsmith.serve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no cache slot yet
    RUNNING = "running"  # owns a slot; prefilling while num_computed < len(prompt)
    FINISHED = "finished"


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
    num_reported: int = 0  # output tokens already reported (`report`)
    reported: bool = False  # its first report went out

    @classmethod
    def new(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
            seed: int, generator: torch.Generator) -> Request:
        """A waiting request, with empty logprob lists where its params ask for logprobs."""
        return cls(request_id, list(prompt_token_ids), params, generator, prompt=prompt, seed=seed,
                   logprobs=None if params.logprobs is None else [],
                   prompt_logprobs=None if params.prompt_logprobs is None else [None])

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

    def sample_delta(self) -> SampleDelta:
        """What this sample gained since its last report (and counts it reported)."""
        start, self.num_reported = self.num_reported, len(self.output_token_ids)
        done = self.finish_reason is not None
        return SampleDelta(self.index, self.output_token_ids[start:],
                           None if self.logprobs is None else self.logprobs[start:], self.text if done else None,
                           self.finish_reason, self.stop_reason)

    def header(self, num_samples: int) -> RequestHeader:
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestHeader(self.prompt, self.prompt_token_ids, num_samples, prompt_logprobs)

    def report(self) -> OutputDelta:
        """What the request (its group's samples, for one of n) gained since its last report."""
        if self.group is not None:
            return self.group.report()
        header = None if self.reported else self.header(1)
        self.reported = True
        return OutputDelta(self.request_id, self.status is Status.FINISHED, [self.sample_delta()], header,
                           self.error)


@dataclass
class RequestGroup:
    """The n samples of one request (SamplingParams.n > 1): one request each, prefilled once. It reports for
    all of them, by index, and is finished when all are."""

    request_id: str
    members: list[Request]
    reported: bool = False  # its first report went out

    @property
    def finished(self) -> bool:
        return all(m.status is Status.FINISHED for m in self.members)

    def report(self) -> OutputDelta:
        """What the group's samples gained since its last report (every sample, moved or not)."""
        first = self.members[0]
        header = None if self.reported else first.header(len(self.members))
        self.reported = True
        return OutputDelta(self.request_id, self.finished, [m.sample_delta() for m in self.members], header,
                           next((m.error for m in self.members if m.error is not None), None))
