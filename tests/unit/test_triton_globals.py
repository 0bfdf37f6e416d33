"""A Triton kernel may read a module global only when it is a `tl.constexpr` (or a module, or another jit
function): the compiler refuses any other, while the interpreter the CPU tests run under reads them all. The
first GPU check failed every slot-attention test on a plain float global; this catches it on a CPU."""

from __future__ import annotations

import importlib
import types

import pytest

KERNEL_MODULES = ["draftsmith.models.slot_attention_triton", "draftsmith.methods.draft_pick_triton",
                  "draftsmith.serve.speculation.rejection_triton"]


def _is_kernel(value) -> bool:
    """A @triton.jit function, compiled (JITFunction) or under TRITON_INTERPRET=1 (InterpretedFunction)."""
    return type(value).__module__.startswith("triton.") and callable(getattr(value, "fn", None))


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernels_read_only_constexpr_globals(name):
    triton = pytest.importorskip("triton", reason="Triton is not installed")
    tl = triton.language
    module = importlib.import_module(name)
    kernels = [v for v in vars(module).values() if _is_kernel(v)]
    assert kernels, f"{name} defines no @triton.jit kernel"
    for kernel in kernels:
        for global_name in kernel.fn.__code__.co_names:
            if global_name not in kernel.fn.__globals__:
                continue  # an attribute (tl.load) or a builtin
            value = kernel.fn.__globals__[global_name]
            assert isinstance(value, (types.ModuleType, tl.constexpr)) or _is_kernel(value), \
                f"{kernel.fn.__name__} reads global {global_name} = {value!r}: make it a tl.constexpr"
