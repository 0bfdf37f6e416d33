"""Which Triton kernels run: each on CUDA by default, PyTorch elsewhere, chosen per kernel by a variable:
`DRAFTSMITH_ATTENTION` (the slot attention of decode and verify forwards, `models.slot_attention_triton`) and
`DRAFTSMITH_DRAFT_PICK` (a greedy draft step's pick, `methods.draft_pick_triton`). Each is `auto` (the
default), `triton` (also on CPU, under Triton's interpreter, `TRITON_INTERPRET=1`: how the tests run the
engine through the kernels) or `torch`. Whatever runs them, a kernel's tensors are on CUDA, or on CPU only
under the interpreter (`check_kernel_devices`)."""

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


def kernel_wanted(device: torch.device | str, variable: str) -> bool:
    """Whether the kernel `variable` governs runs for tensors on `device`."""
    choice = os.environ.get(variable, "auto").lower()
    if choice not in BACKENDS:
        raise DraftsmithError(f"{variable}={choice!r}: one of {', '.join(BACKENDS)}")
    if choice == "torch":
        return False
    on_cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        return on_cuda and _triton_available()
    if not _triton_available():
        raise DraftsmithError(f"{variable}=triton, but Triton is not installed")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise DraftsmithError(f"{variable}=triton on CPU runs only under Triton's interpreter: set TRITON_INTERPRET=1")
    return True


def slot_kernel_wanted(device: torch.device | str) -> bool:
    return kernel_wanted(device, "DRAFTSMITH_ATTENTION")


def draft_pick_wanted(device: torch.device | str) -> bool:
    return kernel_wanted(device, "DRAFTSMITH_DRAFT_PICK")


def check_kernel_devices(kernel: str, **tensors: torch.Tensor | None) -> None:
    """Raises unless the tensor arguments of `kernel` (None: an optional one left out) share one device a Triton
    kernel can read: CUDA, or CPU under Triton's interpreter. Without this, a CPU tensor reaches a GPU launch
    as a bad pointer, and a CPU test run outside the interpreter fails deep inside Triton. Attribute reads
    alone: no sync, so a CUDA graph can capture it."""
    first_name, first = None, None
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if first is None:
            first_name, first = name, tensor
        elif tensor.device != first.device:
            raise DraftsmithError(f"{kernel}: {name} is on {tensor.device} but {first_name} on {first.device}: "
                                  f"a kernel's tensors share one device")
    if first is not None and first.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise DraftsmithError(f"{kernel}: {first_name} is on {first.device}: Triton kernels run on CUDA, or on "
                              f"CPU only under Triton's interpreter (TRITON_INTERPRET=1)")
