"""The speculative serving engine: offline `LLM` API now, HTTP server and proposers in later issues."""

from draftsmith.serve.llm import LLM
from draftsmith.serve.request import CompletionOutput, RequestOutput
from draftsmith.serve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
