"""Which attention decode and verify forwards run: the Triton slot kernel on CUDA (`slot_attention_triton`),
PyTorch elsewhere. `DRAFTSMITH_ATTENTION`: `auto` (the default), `triton` (also on CPU, under Triton's
interpreter, `TRITON_INTERPRET=1`: how the tests run the engine through the kernel) or `torch`."""

from __future__ import annotations

import functools
import os

import torch

from draftsmith.errors import DraftsmithError

BACKENDS = ("auto", "triton", "torch")


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def slot_kernel_wanted(device: torch.device | str) -> bool:
    choice = os.environ.get("DRAFTSMITH_ATTENTION", "auto").lower()
    if choice not in BACKENDS:
        raise DraftsmithError(f"DRAFTSMITH_ATTENTION={choice!r}: one of {', '.join(BACKENDS)}")
    if choice == "torch":
        return False
    on_cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        return on_cuda and _triton_available()
    if not _triton_available():
        raise DraftsmithError("DRAFTSMITH_ATTENTION=triton, but Triton is not installed")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise DraftsmithError("DRAFTSMITH_ATTENTION=triton on CPU runs only under Triton's interpreter: set "
                              "TRITON_INTERPRET=1")
    return True
