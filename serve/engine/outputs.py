"""What the engine hands back each step, and the one place it becomes vLLM's cumulative `RequestOutput`.

Each step reports, per request that moved, what it gained since its last report (`OutputDelta`): new token
ids and their logprobs, and a sample's final text once it finished. A request's first report also names it
whole (`RequestHeader`: prompt, prompt ids, samples, prompt logprobs). So nothing copies a request's whole
output per step, and a reader that wants vLLM's shape merges the deltas in order (`OutputBuilder`; many
requests at once: `OutputCollector`).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.serve.engine.logprobs import Logprob


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
    """A request's outputs so far (vLLM's shape): every sample's tokens, text and logprobs from the start."""

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
class SampleDelta:
    index: int  # the sample's place among the request's n
    token_ids: list[int]  # new since the last report
    logprobs: list[dict[int, Logprob]] | None  # their entries, when the request asked for logprobs
    text: str | None  # the final text, once the sample finished
    finish_reason: str | None
    stop_reason: int | str | None

    @property
    def size(self) -> int:
        return len(self.token_ids) + sum(len(entry) for entry in self.logprobs or ())


@dataclass
class RequestHeader:
    """What a request's first report says of it once."""

    prompt: str | None
    prompt_token_ids: list[int]
    num_samples: int
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # per prompt token, when asked for


@dataclass
class OutputDelta:
    request_id: str
    finished: bool
    samples: list[SampleDelta]
    header: RequestHeader | None = None  # in the request's first report only
    error: str | None = None  # why the engine failed this request alone (finish reason "error")

    @property
    def size(self) -> int:
        """Token ids plus logprob entries it carries (what a reader's backlog counts)."""
        header = self.header.prompt_logprobs if self.header is not None else None
        return sum(s.size for s in self.samples) + len(header or ())


class OutputBuilder:
    """One request's cumulative output, updated in place by each of its deltas, in order."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], num_samples: int):
        self.output = RequestOutput(request_id, prompt, list(prompt_token_ids),
                                    [CompletionOutput(i, "", [], None) for i in range(num_samples)], False)

    @classmethod
    def from_header(cls, request_id: str, header: RequestHeader) -> OutputBuilder:
        return cls(request_id, header.prompt, header.prompt_token_ids, header.num_samples)

    def add(self, delta: OutputDelta) -> RequestOutput:
        out = self.output
        if delta.header is not None and delta.header.prompt_logprobs is not None:
            out.prompt_logprobs = delta.header.prompt_logprobs
        for d in delta.samples:
            sample = out.outputs[d.index]
            sample.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                sample.logprobs.extend(d.logprobs)
            if d.text is not None:
                sample.text = d.text
            sample.finish_reason, sample.stop_reason = d.finish_reason, d.stop_reason
        out.finished, out.error = delta.finished, delta.error
        return out


class OutputCollector:
    """The cumulative outputs of every request an engine reports, for callers that step an engine themselves
    (`LLM.generate`, benchmarks, tests)."""

    def __init__(self):
        self._builders: dict[str, OutputBuilder] = {}

    def add(self, delta: OutputDelta) -> RequestOutput:
        """The request's output with `delta` merged in (one object per request, updated in place by each of
        its deltas); a finished request is forgotten afterwards."""
        builder = self._builders.get(delta.request_id)
        if builder is None:
            if delta.header is None:
                raise ValueError(f"request {delta.request_id}: its first report has no header (collected late?)")
            builder = self._builders[delta.request_id] = OutputBuilder.from_header(delta.request_id, delta.header)
        output = builder.add(delta)
        if delta.finished:
            del self._builders[delta.request_id]
        return output

    def add_all(self, deltas: list[OutputDelta]) -> list[RequestOutput]:
        return [self.add(delta) for delta in deltas]
