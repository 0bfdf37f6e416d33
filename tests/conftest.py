"""Fixtures: seeded RNG and a session-wide engine on the embedded demo model."""

from __future__ import annotations

import pytest
import torch

from helpers import DEMO_MODEL


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def demo_llm():
    from draftsmith.serve import LLM

    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=512)
