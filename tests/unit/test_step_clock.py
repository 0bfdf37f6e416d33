"""The decode step synchronises the device only when a speculation policy or the profiling flag reads device
time: counted by patching `torch.cuda.synchronize` under an engine whose clock believes it runs on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draftsmith.serve import LLM, SamplingParams
from helpers import CODE_PROMPTS, DEMO_MODEL, spec_config, synthetic_table

EAGLE3 = {"method": "eagle3", "model": str(DEMO_MODEL.parent / "demo-code-7m-eagle3"), "num_speculative_tokens": 3}


@pytest.fixture
def count_syncs(monkeypatch):
    """Runs `llm` over two prompts with its engine's clock on a make-believe CUDA device -> synchronizes."""

    def run(llm: LLM) -> int:
        calls = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
        engine = llm.engine
        engine.clock = dataclasses.replace(engine.clock, device=torch.device("cuda"))
        llm.generate(CODE_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        return len(calls)

    return run


def _llm(target, **kwargs) -> LLM:
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256, target=target, **kwargs)


def test_plain_and_fixed_k_steps_never_synchronize(target, count_syncs):
    assert count_syncs(_llm(target)) == 0
    assert count_syncs(_llm(target, speculative_config=spec_config(**EAGLE3))) == 0
    assert count_syncs(_llm(target, speculative_config=spec_config("ngram", k=3))) == 0


def test_an_adaptive_policy_or_the_profiling_flag_times_steps_on_the_device(target, count_syncs, monkeypatch):
    assert count_syncs(_llm(target, profile_steps=True)) > 0
    monkeypatch.setattr(LLM, "_forward_costs", lambda self, model_dir: synthetic_table(1.0))
    adaptive = _llm(target, speculative_config=EAGLE3)
    assert count_syncs(adaptive) > 0
