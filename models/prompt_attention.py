"""Causal attention of prompt chunks over their rows' slots of the KV cache: query i of a chunk starting at
position `start` sees its slot's keys 0..start + i (the chunk's own keys and values already written).

`prompt_attention` runs the C++ kernel (prompt_attention_cpu.cpp, built with the CPU attention kernel) where
it applies: fp32 CPU tensors, head_dim a multiple of 64, eager, the kernel loaded. There it beats PyTorch's
flash SDPA, which reads keys in blocks of 512 and so computes almost the whole square of a 550-token prompt's
scores (measurements: docs/decisions/cpu-kernels.md). `prompt_attention_reference` is the same in PyTorch
ops, which the tests hold the kernel to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.models.kernel_backend import cpu_attention_kernel_wanted

# (slot, start, count, first token in q) of each chunk: its tokens are q[first : first + count]
Span = tuple[int, int, int, int]


def kernel_applies(q: torch.Tensor) -> bool:
    """Whether `prompt_attention` runs the C++ kernel for q [..., D] (eager only: a compiled step traces SDPA;
    `DRAFTSMITH_ATTENTION=torch` turns it off with the slot kernel)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[-1] % 64 == 0
            and not torch.compiler.is_compiling() and cpu_attention_kernel_wanted())


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: list[Span],
                     scale: float | None = None) -> torch.Tensor:
    """q [T, H, D] (head_dim contiguous), caches [S, KVH, L, D] -> [T, H, D]: each span's tokens attend
    causally over their slot's keys up to their own position. Tokens in no span come back as zeros."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if kernel_applies(q):
        return torch.ops.draftsmith_cpu.prompt_attention(q, k_cache, v_cache, torch.tensor(spans, dtype=torch.long)
                                                         .view(-1, 4), scale)
    return prompt_attention_reference(q, k_cache, v_cache, spans, scale)


def padded_prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: list[int]) -> torch.Tensor:
    """q [B, H, Q, D] of B prompts from position 0 padded to Q (a padding query's output is never read) ->
    [B, H, Q, D], through the kernel (`kernel_applies`)."""
    rows, heads, width, dim = q.shape
    tokens = q.transpose(1, 2).reshape(rows * width, heads, dim)
    spans = [(slot, 0, width, b * width) for b, slot in enumerate(slots)]
    return prompt_attention(tokens, k_cache, v_cache, spans).view(rows, width, heads, dim).transpose(1, 2)


def prompt_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spans: list[Span],
                               scale: float | None = None) -> torch.Tensor:
    """`prompt_attention` in PyTorch ops: SDPA per span, its own causal kernel where the span starts at 0."""
    out = torch.zeros_like(q)
    for slot, start, count, first in spans:
        if not count:
            continue
        query = q[first : first + count].transpose(0, 1)[None]  # [1, H, n, D]
        keys, values = k_cache[slot : slot + 1, :, : start + count], v_cache[slot : slot + 1, :, : start + count]
        if start == 0:
            attended = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True,
                                                      scale=scale)
        else:
            seen = torch.arange(start + count, device=q.device)[None, :] <= start + torch.arange(count, device=q.device)[:, None]
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=seen, enable_gqa=True,
                                                      scale=scale)
        out[first : first + count] = attended[0].transpose(0, 1)
    return out
