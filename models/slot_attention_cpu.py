"""`slot_attention` on CPU: the C++ kernel in slot_attention_cpu.cpp (rules in slot_attention_reference.py),
built once per machine by torch.utils.cpp_extension (g++ and ninja; about 35 s on two cores, kept in
torch's extension cache) and called as the torch op `draftsmith_cpu::slot_attention`, which a compiled step
runs as an extern kernel. The same build holds step_ops_cpu.cpp's ops (`models.step_ops_cpu`)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError

log = logging.getLogger("draftsmith")

SOURCES = [Path(__file__).with_name(name) for name in (
    "slot_attention_cpu.cpp", "step_ops_cpu.cpp", "ngram_lookup_cpu.cpp", "prompt_attention_cpu.cpp",
    "panel_linear_cpu.cpp", "draft_step_cpu.cpp")]
HEADERS = [Path(__file__).with_name("simd_exp.h")]  # torch's build cache hashes the sources only: in the name
# -ffp-contract=fast: multiply-adds fused (ISO C++ mode, which torch builds in, leaves them apart)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
# whether this process has loaded the build (`build_error` found it): its other ops run only then, so that no
# norm or rope call builds it in the middle of a forward
LOADED = False


def _build_name() -> str:
    """The build's name, one per instruction set (-march=native) and version of the headers: a cache shared by
    machines of other CPUs builds its own."""
    flags = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags += next((line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))), "")
    flags += "".join(header.read_text() for header in HEADERS)
    return f"draftsmith_slot_attention_cpu_{hashlib.sha256(flags.encode()).hexdigest()[:10]}"


@functools.cache
def build_error() -> str | None:
    """Builds (or finds built) and loads the kernel once per process -> None, or why it cannot run here."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # pip's ninja installs beside the interpreter, maybe off PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        log.info("loading the CPU attention kernel (built on first use: about 35 s on two cores)")
        cpp_extension.load(_build_name(), [str(source) for source in SOURCES], extra_cflags=FLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        log.debug("the CPU attention kernel's build: %s", error)
        return _reason(str(error)) or type(error).__name__
    torch.library.register_fake("draftsmith_cpu::slot_attention")(_fake)
    torch.library.register_fake("draftsmith_cpu::panel_linear")(_fake_linear)
    global LOADED
    LOADED = True
    return None


def _reason(output: str) -> str:
    """A failed build's output -> its first line that says what went wrong (a compiler's error, a tool not
    found), not ninja's closing 'build stopped'."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    telling = [line for line in lines if "error" in line.lower() or "not found" in line.lower()]
    return (telling or lines or [""])[0][:300]


def _fake(q, k_cache, v_cache, slots, positions, kv_lens, key_starts, window, tree_mask, block_starts, scale,
          query_starts=None):
    return q.new_empty(q.shape)  # [B, H, Q, D], or packed [T, H, D]


def _fake_linear(x, panels, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def slot_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       positions: torch.Tensor, kv_lens: torch.Tensor, key_starts: torch.Tensor | None = None,
                       window: int | None = None, tree_mask: torch.Tensor | None = None,
                       block_starts: torch.Tensor | None = None, scale: float | None = None,
                       query_starts: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Q, D] (any strides); k_cache, v_cache [S, KVH, L, D] (head_dim contiguous); slots, kv_lens
    (and key_starts, block_starts) [B]; positions [B, Q]; tree_mask [B, Q, Q] bool -> [B, H, Q, D] in q's
    dtype, computed in fp32. Each row reads its own keys, up to its kv_lens. With `query_starts` [B + 1], q
    and the output are packed, [T, H, D]: row b's real queries are q[query_starts[b]:query_starts[b + 1]],
    at its first positions (a packed verify's tokens; no tree)."""
    if not torch.compiler.is_compiling():  # a traced step was built by an engine that loaded it
        error = build_error()
        if error is not None:
            raise DraftsmithError(f"the CPU attention kernel did not build: {error}")
    return torch.ops.draftsmith_cpu.slot_attention(q, k_cache, v_cache, slots, positions, kv_lens, key_starts,
                                                   window, tree_mask, block_starts,
                                                   scale if scale is not None else q.shape[-1] ** -0.5,
                                                   query_starts)
