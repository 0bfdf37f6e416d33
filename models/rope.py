"""Rotary position embeddings, computed exactly as HF transformers does (fp32 frequencies, cast late)."""

from __future__ import annotations

import torch

from draftsmith.errors import UnsupportedModelError
from draftsmith.models import step_ops_cpu
from draftsmith.models.config import SUPPORTED_ROPE_TYPES, RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], fp32, from transformers' own init function for the type."""
    from transformers import LlamaConfig

    if rope.type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope.type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # The init functions read only head_dim and the rope keys. max_position_embeddings is set to the scaled
    # context because transformers 5 warns when llama3's original length is not below it.
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                         max_position_embeddings=int(rope.original_max_position_embeddings * rope.factor),
                         **rope.hf_keys())
    inv_freq, attention_factor = _init_function(rope.type)(config, device=None)  # 4.x requires `device`
    if attention_factor != 1.0:  # rope_tables has no cos/sin scale; refuse rather than compute wrong tables
        raise UnsupportedModelError(f"rope type {rope.type!r} scales attention by {attention_factor}; not supported")
    return inv_freq.float()


def _init_function(rope_type: str):
    """transformers' rope init function: `ROPE_INIT_FUNCTIONS` holds the scaled types (and, in 4.x, `default`);
    5.x moved `default` onto each model's rotary class."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type in ROPE_INIT_FUNCTIONS:
        return ROPE_INIT_FUNCTIONS[rope_type]
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding.compute_default_rope_parameters


def rope_tables(rope: RopeConfig, head_dim: int, max_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, head_dim] in fp32, indexed by absolute position."""
    inv_freq = inverse_frequencies(rope, head_dim).to(device)
    positions = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, Q, head_dim]; cos/sin [B, Q, head_dim] already in x's dtype."""
    return _turn(x, cos.unsqueeze(1), sin.unsqueeze(1))


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by cos/sin already broadcastable to it."""
    return x * cos + rotate_half(x) * sin


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` of q [..., heads, head_dim] and k [..., kv_heads, head_dim] (heads before head_dim, as a
    projection's output viewed per head); cos/sin [..., head_dim]. Where k follows q in memory, as the
    views of a fused q/k/v projection do, both turn in one pass: on CPU each small op of a decode step costs
    5-20 us whatever its size, and one pass is 5 ops a layer, not 10. Same arithmetic either way."""
    heads = q.shape[-2]
    if _follows(q, k):
        both = q.as_strided(q.shape[:-2] + (heads + k.shape[-2], q.shape[-1]), q.stride(), q.storage_offset())
        turned = apply_rope_heads(both, cos, sin)
        return turned[..., :heads, :], turned[..., heads:, :]
    return apply_rope_heads(q, cos, sin), apply_rope_heads(k, cos, sin)


def apply_rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim] rotated by cos/sin [..., head_dim]: one C++ op where it is loaded and the
    tables have a row per position of x (`models.step_ops_cpu`), else five aten ops."""
    if step_ops_cpu.runs_for(x) and cos.shape[:-1] == x.shape[:-2] and cos.dtype == sin.dtype == x.dtype:
        return step_ops_cpu.rope(x, cos, sin)
    return _turn(x, cos.unsqueeze(-2), sin.unsqueeze(-2))


def _follows(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k's heads continue q's in one buffer with the same strides (one tensor of heads + kv_heads).
    Never while torch.compile traces: storage addresses are not traceable, and Inductor fuses the two turns."""
    if torch.compiler.is_compiling():
        return False
    return (q.shape[:-2] == k.shape[:-2] and q.shape[-1] == k.shape[-1] and q.stride() == k.stride()
            and q.dtype == k.dtype and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
            and k.storage_offset() == q.storage_offset() + q.shape[-2] * q.stride(-2))
