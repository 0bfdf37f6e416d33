"""The speculative serving engine, one folder per subsystem:

- `engine/`: the engine core: requests, the scheduler and its step, sampling, stopping, logprobs, step graphs;
- `speculation/`: the `--speculative-config` schema, verification (chains and trees, rejection sampling) and
  the policy that sizes each step, with its cost model;
- `client/`: what talks to the engine: the prompt checks at the edge, the engine on a thread or in a process;
- `openai/`: the OpenAI-compatible HTTP server and `draftsmith serve`;
- `apps/`: the offline `LLM` API, `draftsmith generate`, `datagen` and `demo`;
- `bench/`: `draftsmith bench` and `bench-serve`.

Proposers come from `draftsmith.methods`."""

from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.engine.outputs import CompletionOutput, RequestOutput
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.engine.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
