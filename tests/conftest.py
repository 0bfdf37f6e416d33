"""Fixtures: seeded RNG, and the embedded demo model session-wide: an engine, a target, greedy references (and
for the tests marked `cuda`, a target and a reference on KERNEL_DEVICE). `DRAFTSMITH_GPU_CHECK=1` (`make
gpu-check`) refuses to start a session that could not run them on a GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import DEMO_MODEL, KERNEL_DEVICE, greedy_token_ids


def gpu_check_problem() -> str | None:
    """Why a `DRAFTSMITH_GPU_CHECK=1` session would prove nothing here, or None: it needs CUDA, and kernels run
    by Triton's interpreter are not the GPU's."""
    if os.environ.get("DRAFTSMITH_GPU_CHECK") != "1":
        return None
    if not torch.cuda.is_available():
        return "DRAFTSMITH_GPU_CHECK=1 but CUDA is not available: the GPU check runs on a machine with a GPU"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ("DRAFTSMITH_GPU_CHECK=1 with TRITON_INTERPRET=1: the kernels would run in Triton's interpreter, "
                "not on the GPU; unset TRITON_INTERPRET")
    return None


def pytest_configure(config):
    problem = gpu_check_problem()
    if problem is not None:
        raise pytest.UsageError(problem)


INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config, items):
    """The tiers: every test under integration/ runs end to end (a server, a subprocess, training, the real
    models) and is `slow`; in unit/, the tests that are slow carry the mark themselves. `make test-fast`
    runs the rest (`-m "not slow"`)."""
    for item in items:
        if INTEGRATION in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.slow)


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
    from draftsmith.serve import LLM

    return greedy_token_ids(LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256))


@pytest.fixture(scope="session")
def kernel_target(request):
    """The demo model as a float32 target on KERNEL_DEVICE, for the tests marked `cuda`: on CPU the session's
    `target` itself (nothing loads twice)."""
    if KERNEL_DEVICE == "cpu":
        return request.getfixturevalue("target")
    from draftsmith.models import load_target

    return load_target(DEMO_MODEL, dtype="float32", device=KERNEL_DEVICE)


@pytest.fixture(scope="session")
def kernel_greedy_reference(request):
    """Plain greedy token ids of CODE_PROMPTS (32 tokens each) on KERNEL_DEVICE: what a `cuda` test's kernel or
    static path must reproduce there. On CPU the session's `greedy_reference`. On CUDA, plain decoding's
    reference path on the GPU itself (eager steps, PyTorch's attention): CUDA rounds fp32 otherwise than the
    CPU does, so a CPU reference may differ from any GPU run at a near tie."""
    if KERNEL_DEVICE == "cpu":
        return request.getfixturevalue("greedy_reference")
    from draftsmith.serve import LLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTSMITH_ATTENTION", "torch")
        llm = LLM(DEMO_MODEL, dtype="float32", device=KERNEL_DEVICE, max_num_seqs=3, max_model_len=256,
                  target=request.getfixturevalue("kernel_target"), enforce_eager=True)
        return greedy_token_ids(llm)


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory):
    """Forward-cost profiles go to a per-session folder, not the user's ~/.cache."""
    os.environ["DRAFTSMITH_CACHE_DIR"] = str(tmp_path_factory.mktemp("draftsmith-cache"))
