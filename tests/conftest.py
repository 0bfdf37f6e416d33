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


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory):
    """Forward-cost profiles go to a per-session folder, not the user's ~/.cache."""
    import os

    os.environ["DRAFTSMITH_CACHE_DIR"] = str(tmp_path_factory.mktemp("draftsmith-cache"))
