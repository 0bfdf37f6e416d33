"""The speculative serving engine: continuous batching over a per-slot KV cache, verification of any
registered method's drafts (`spec_decode`), the offline `LLM` API, `draftsmith generate`/`datagen`/`bench`,
and `draftsmith serve` (OpenAI-compatible HTTP, `api_server`). Proposers come from `draftsmith.methods`."""

from draftsmith.serve.llm import LLM
from draftsmith.serve.request import CompletionOutput, RequestOutput
from draftsmith.serve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
