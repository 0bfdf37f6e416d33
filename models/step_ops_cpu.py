"""The small ops of an eager forward on CPU, one C++ op each (step_ops_cpu.cpp, built with the CPU attention
kernel): RMSNorm, a residual add with the RMSNorm after it, the MLP's SiLU times up and rope of fp32 and bf16
tensors, the write of new keys and values into their slots, a draft's greedy pick, greedy token ids and a greedy Markov chain (DSpark). On CPU each small aten op of a decode step
costs a few microseconds whatever its size, and PyTorch runs a norm as six, a rope as five and a write as an
index_put. They run only where this process has loaded the build (the engine
does at start, `kernel_backend.slot_kernel_wanted`) and nothing records autograd; a compiled step traces
PyTorch's ops, which Inductor fuses itself. `DRAFTSMITH_CPU_OPS=torch` turns them off (read once a
process)."""

from __future__ import annotations

import functools
import os

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models import slot_attention_cpu

VARIABLE = "DRAFTSMITH_CPU_OPS"
# fp32, and bf16: a draft head on a CPU with fast bf16 matmuls (`methods.heads.draft_dtype`) runs four norms
# and a rope per draft step, as op-by-op bf16 they were a third of the demo EAGLE-3 head's propose time
STEP_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _allowed() -> bool:
    choice = os.environ.get(VARIABLE, "auto").lower()
    if choice not in ("auto", "torch"):
        raise DraftsmithError(f"{VARIABLE}={choice!r}: one of auto, torch")
    return choice == "auto"


def enabled() -> bool:
    """Whether this process has loaded the build and may run its ops (the variable does not say torch)."""
    return slot_attention_cpu.LOADED and _allowed()


def runs_for(x: torch.Tensor) -> bool:
    """Whether `x` (and a norm's weight or a rope's tables of its dtype) goes through these ops."""
    return (x.dtype in STEP_DTYPES and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and enabled())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, weight.shape, weight, eps) for fp32 x and weight; for bf16, transformers' LlamaRMSNorm
    (fp32 statistics, the normalised row rounded to bf16 before the weight)."""
    return torch.ops.draftsmith_cpu.rms_norm.default(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual, weight, eps)) in one pass: the sum rounded as PyTorch's add rounds
    it, the norm bit for bit `rms_norm`'s of the sum."""
    return torch.ops.draftsmith_cpu.add_rms_norm.default(x, residual, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up (to within a few fp32 ulp: its exp is simd_exp.h's; in bf16 rounded where PyTorch's two
    ops round) -> a new contiguous tensor; gate and up may be views into one fused projection."""
    return torch.ops.draftsmith_cpu.silu_mul.default(gate, up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim] (head_dim contiguous) rotated by cos/sin [..., head_dim] (one row per leading
    position of x, shared by its heads) -> a new tensor: x * cos + rotate_half(x) * sin."""
    return torch.ops.draftsmith_cpu.rope.default(x, cos, sin)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> None:
    """cache[slots[b, q], :, positions[b, q]] = new[b, :, q]: new [B, heads, Q, head_dim] into cache [S, heads,
    L, head_dim] (head_dim contiguous in both), in place."""
    torch.ops.draftsmith_cpu.write_kv.default(cache, slots, positions, new)


def greedy_pick(logits: torch.Tensor, d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_pick_reference.greedy_pick_reference` in one pass a row: logits [A, V] (fp32 or bf16) -> (the
    first index of each row's largest logit, plus d2t's offset there when given [A] int64; its softmax
    probability [A] fp32, to within a few fp32 ulp). Softmax, max and the offset's gather were four ops,
    16 us a one-row draft step on a 4096-token draft vocabulary."""
    return torch.ops.draftsmith_cpu.greedy_pick.default(logits, d2t)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (fp32 or bf16 [..., V] -> int64 [...]): the first index of each row's largest value, a
    NaN counting as larger than any number, as torch's. aten's took 142 us over a verify's [8, 5, 8192] logits
    on this CPU's two threads."""
    return torch.ops.draftsmith_cpu.greedy_ids.default(logits)


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), by `greedy_ids` where these ops run for the logits: every greedy choice of a token
    (the target's verify and decode, a parallel drafter's block, Medusa's heads) takes it."""
    return greedy_ids(logits) if runs_for(logits) else logits.argmax(-1)


def markov_chain(base: torch.Tensor, table: torch.Tensor, row_of: torch.Tensor, start_tokens: torch.Tensor,
                 drafted: torch.Tensor, start: int) -> int:
    """Greedy drafts along a block (`MarkovBiasRows.greedy_chain`): drafted[a, j] = (base[a, j] + table[row_of[t]])
    .argmax(), t the token before position j (start_tokens[a], then drafted[a, j - 1]), from position `start`
    on, in place; base fp32 [A, W, V], table fp32 [C, V], row_of int64 [V] (-1: no kept row). -> the first
    position where some row's token had no kept row (the ones before it drafted), or W when all are."""
    return torch.ops.draftsmith_cpu.markov_chain.default(base, table, row_of, start_tokens, drafted, start)
