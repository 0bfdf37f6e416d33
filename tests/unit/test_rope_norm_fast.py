"""The one-kernel RMSNorm and the one-pass q/k rotation compute what the op-by-op forms compute, bit for bit
(PyTorch's ops; the C++ step ops a loaded engine runs instead are tested in test_step_ops_cpu.py)."""

import pytest
import torch

from draftsmith.models import slot_attention_cpu
from draftsmith.models.llama import RMSNorm
from draftsmith.models.rope import _follows, apply_rope, apply_rope_qk


@pytest.fixture(autouse=True)
def pytorch_ops(monkeypatch):
    monkeypatch.setattr(slot_attention_cpu, "LOADED", False)


def hf_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 statistics, cast back before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(8, 1, 512), (3, 5, 256), (37, 64), (2, 7, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_hf_formula_bit_for_bit(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=generator))
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), hf_rms_norm(norm, x))


def test_rms_norm_trains():
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(4, 16, requires_grad=True)
    norm(x).square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


def _tables(rows: int, width: int, dim: int):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, dim, generator=generator), torch.randn(rows, width, dim, generator=generator)


def test_q_and_k_of_one_fused_projection_turn_in_one_pass_as_apart():
    rows, width, heads, kv_heads, dim = 3, 4, 8, 2, 64
    qkv = torch.randn(rows, width, (heads + 2 * kv_heads) * dim)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(rows, width, heads, dim), k.view(rows, width, kv_heads, dim)
    cos, sin = _tables(rows, width, dim)
    assert _follows(q, k) and not _follows(k, q)
    got_q, got_k = apply_rope_qk(q, k, cos, sin)
    # the [B, heads, Q, head_dim] form the layers used before
    want_q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2)
    want_k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.shape == q.shape and got_k.shape == k.shape


def test_q_and_k_apart_in_memory_turn_one_by_one():
    rows, width, dim = 2, 3, 32
    q, k = torch.randn(rows, width, 4, dim), torch.randn(rows, width, 2, dim)
    cos, sin = _tables(rows, width, dim)
    assert not _follows(q, k)
    got_q, got_k = apply_rope_qk(q, k, cos, sin)
    assert torch.equal(got_q, apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2))
    assert torch.equal(got_k, apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2))


def test_packed_tokens_turn_alike():
    tokens, heads, kv_heads, dim = 7, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    cos, sin = torch.randn(tokens, dim), torch.randn(tokens, dim)
    got_q, got_k = apply_rope_qk(q, k, cos, sin)
    assert _follows(q, k)
    assert torch.equal(got_q, q * cos[:, None] + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin[:, None])
    assert torch.equal(got_k, k * cos[:, None] + torch.cat((-k[..., 8:], k[..., :8]), -1) * sin[:, None])
