"""Which Triton kernels run: each on CUDA by default, PyTorch elsewhere, chosen per kernel by a variable:
`DRAFTSMITH_ATTENTION` (the slot attention of decode and verify forwards, `models.slot_attention_triton`) and
`DRAFTSMITH_DRAFT_PICK` (a greedy draft step's pick, `methods.draft_pick_triton`). Each is `auto` (the
default), `triton` (also on CPU, under Triton's interpreter, `TRITON_INTERPRET=1`: how the tests run the
engine through the kernels) or `torch`; the attention also `cpp`: on CPU its C++ kernel
(`models.slot_attention_cpu`, what `auto` picks on CPU where it builds), on CUDA what `auto` picks. Whatever
runs the Triton kernels, their tensors are on CUDA, or on CPU only under the interpreter
(`check_kernel_devices`)."""

from __future__ import annotations

import functools
import logging
import os

import torch

from draftsmith.errors import DraftsmithError

BACKENDS = ("auto", "triton", "torch")
ATTENTION = "DRAFTSMITH_ATTENTION"


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _choice(variable: str) -> str:
    choice = os.environ.get(variable, "auto").lower()
    allowed = BACKENDS + ("cpp",) if variable == ATTENTION else BACKENDS
    if choice not in allowed:
        raise DraftsmithError(f"{variable}={choice!r}: one of {', '.join(allowed)}")
    return choice


def cpu_attention_kernel_wanted() -> bool:
    """Whether the slot attention of CPU tensors runs as the C++ kernel: under `cpp`, and under `auto` where
    it builds (else PyTorch's attention, said once); raises where `cpp` was asked for and it does not build."""
    choice = _choice(ATTENTION)
    if choice not in ("cpp", "auto"):
        return False
    from draftsmith.models.slot_attention_cpu import build_error

    error = build_error()
    if error is not None and choice == "cpp":
        raise DraftsmithError(f"{ATTENTION}=cpp, but the CPU attention kernel did not build: {error}")
    if error is not None:
        _warn_once(f"the CPU attention kernel did not build ({error}): PyTorch's attention runs instead")
    return error is None


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger("draftsmith").warning(message)


def kernel_wanted(device: torch.device | str, variable: str) -> bool:
    """Whether the kernel `variable` governs runs for tensors on `device`."""
    choice = _choice(variable)
    on_cpu = torch.device(device).type == "cpu"
    if variable == ATTENTION and on_cpu and choice in ("cpp", "auto"):
        return cpu_attention_kernel_wanted()
    if choice == "cpp":
        choice = "auto"
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
    return kernel_wanted(device, ATTENTION)


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
