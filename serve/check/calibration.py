"""Calibration prompts the target writes itself, so that a check needs no data: from the start-of-text token,
seeded sampling at temperature 1, one seed per prompt. Text a model wrote is text its head was trained to
draft, whatever the domain."""

from __future__ import annotations

from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.engine.sampling_params import SamplingParams

PROMPT_TOKENS = 48


def start_ids(llm: LLM) -> list[int]:
    """What a prompt written from nothing begins with: the tokenizer's start-of-text token, else a newline."""
    bos = getattr(llm.tokenizer, "bos_token_id", None)
    return [bos] if isinstance(bos, int) else llm.tokenizer.encode("\n", add_special_tokens=False)


def calibration_prompts(llm: LLM, count: int, tokens: int = PROMPT_TOKENS) -> list[list[int]]:
    """`count` prompts of `tokens` tokens each, sampled by `llm` (a plain one: no speculation)."""
    start = start_ids(llm)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=tokens, ignore_eos=True) for seed in range(count)]
    outputs = llm.generate([{"prompt_token_ids": start}] * count, params, use_tqdm=False)
    return [start + list(o.outputs[0].token_ids) for o in outputs]
