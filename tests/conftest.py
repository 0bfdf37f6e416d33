"""Fixtures: seeded RNG, and the embedded demo model session-wide: an engine, a target, greedy references."""

from __future__ import annotations

import pytest
import torch

from helpers import CODE_PROMPTS, DEMO_MODEL


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def demo_llm():
    from draftsmith.serve import LLM

    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="session")
def target():
    """The demo model as a float32 target, shared by the session (heads attach to it; nothing changes it)."""
    from draftsmith.models import load_target

    return load_target(DEMO_MODEL, dtype="float32")


@pytest.fixture(scope="session")
def greedy_reference():
    """Plain greedy token ids of CODE_PROMPTS, 32 tokens each: what every speculating run must reproduce."""
    from draftsmith.serve import LLM, SamplingParams

    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256)
    outputs = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory):
    """Forward-cost profiles go to a per-session folder, not the user's ~/.cache."""
    import os

    os.environ["DRAFTSMITH_CACHE_DIR"] = str(tmp_path_factory.mktemp("draftsmith-cache"))
