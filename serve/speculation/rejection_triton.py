# ruff: noqa: N803, N806
"""Rejection sampling as one Triton kernel (one program per request); math in rejection_reference.py.

Each program walks its row's draft tokens, keeping a running "still accepting" flag (Triton loops have no
`break`), writes the accepted drafts, then scans the vocabulary in BLOCK_V chunks for the recovered or
bonus token: argmax of max(0, p - q) / noise, falling back to p / noise when the residual has no mass.
Written for this project from the algorithm in Leviathan et al. 2023 and vLLM's kernel layout notes.
"""

from __future__ import annotations

import torch

from draftsmith.models.kernel_backend import check_kernel_devices

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses the PyTorch reference there
    triton = None

BLOCK_V = 1024


if triton is not None:

    @triton.jit
    def _rejection_sample_forward_kernel(
        out_ptr,  # [B, K + 1] int64
        num_out_ptr,  # [B] int64
        target_probs_ptr,  # [B, K + 1, V] fp32
        target_argmax_ptr,  # [B, K + 1] int64
        draft_tokens_ptr,  # [B, K] int64
        num_draft_ptr,  # [B] int64
        draft_probs_ptr,  # [B, K, V] fp32 (unused without HAS_DRAFT_PROBS)
        uniforms_ptr,  # [B, K] fp32
        noise_ptr,  # [B, V] fp32
        is_greedy_ptr,  # [B] int8
        synthetic_rate,
        K,
        V,
        HAS_DRAFT_PROBS: tl.constexpr,
        SYNTHETIC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        num_draft = tl.load(num_draft_ptr + b)
        greedy = tl.load(is_greedy_ptr + b) != 0
        num_accepted = num_draft * 0
        alive = num_draft >= 0  # True
        for i in range(0, K):
            x = tl.load(draft_tokens_ptr + b * K + i)
            safe_x = tl.maximum(x, 0)
            p_x = tl.load(target_probs_ptr + (b * (K + 1) + i) * V + safe_x)
            if HAS_DRAFT_PROBS:
                q_x = tl.load(draft_probs_ptr + (b * K + i) * V + safe_x)
            else:
                q_x = 1.0
            u = tl.load(uniforms_ptr + b * K + i)
            if SYNTHETIC:
                ok = u < synthetic_rate
            else:
                ok_sampled = (q_x > 0) & (p_x > u * q_x)
                ok_greedy = x == tl.load(target_argmax_ptr + b * (K + 1) + i)
                ok = tl.where(greedy, ok_greedy, ok_sampled)
            alive = alive & ok & (i < num_draft)
            tl.store(out_ptr + b * (K + 1) + i, tl.where(alive, x, -1))
            num_accepted += alive.to(tl.int64)
        tl.store(out_ptr + b * (K + 1) + K, -1)

        row = b * (K + 1) + num_accepted
        rejected_here = num_accepted < num_draft
        at = tl.minimum(num_accepted, tl.maximum(K - 1, 0))
        x_rej = tl.load(draft_tokens_ptr + b * K + at, mask=K > 0, other=-1)
        best_res = -1.0
        best_res_idx = num_draft * 0
        best_p = -1.0
        best_p_idx = num_draft * 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            in_vocab = offs < V
            p = tl.load(target_probs_ptr + row * V + offs, mask=in_vocab, other=0.0)
            if HAS_DRAFT_PROBS:
                q = tl.load(draft_probs_ptr + (b * K + at) * V + offs, mask=in_vocab, other=0.0)
                q = q * rejected_here.to(tl.float32)
            else:
                q = tl.where((offs == x_rej) & rejected_here, 1.0, 0.0)
            noise = tl.load(noise_ptr + b * V + offs, mask=in_vocab, other=1.0)
            residual = tl.maximum(p - q, 0.0)
            score = tl.where(in_vocab, residual / noise, -1.0)
            block_best = tl.max(score, axis=0)
            block_idx = tl.argmax(score, axis=0).to(tl.int64) + start
            take = block_best > best_res
            best_res_idx = tl.where(take, block_idx, best_res_idx)
            best_res = tl.where(take, block_best, best_res)
            score_p = tl.where(in_vocab, p / noise, -1.0)
            block_best_p = tl.max(score_p, axis=0)
            block_idx_p = tl.argmax(score_p, axis=0).to(tl.int64) + start
            take_p = block_best_p > best_p
            best_p_idx = tl.where(take_p, block_idx_p, best_p_idx)
            best_p = tl.where(take_p, block_best_p, best_p)
        recovered = tl.where(best_res > 0, best_res_idx, best_p_idx)
        final = tl.where(greedy, tl.load(target_argmax_ptr + row), recovered)
        tl.store(out_ptr + b * (K + 1) + num_accepted, final)
        tl.store(num_out_ptr + b, num_accepted + 1)


def rejection_sample_triton(target_probs, target_argmax, draft_tokens, num_draft, draft_probs, uniforms, noise,
                            is_greedy, synthetic_rate=None):
    """Same contract as `rejection_sample_reference`."""
    if triton is None:
        raise RuntimeError("Triton is not installed: pip install 'draftsmith[triton]'")
    check_kernel_devices("rejection_sample_triton", target_probs=target_probs, target_argmax=target_argmax,
                         draft_tokens=draft_tokens, num_draft=num_draft, draft_probs=draft_probs, uniforms=uniforms,
                         noise=noise, is_greedy=is_greedy)
    rows, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    out = torch.empty(rows, k + 1, dtype=torch.long, device=draft_tokens.device)
    num_out = torch.empty(rows, dtype=torch.long, device=draft_tokens.device)
    _rejection_sample_forward_kernel[(rows,)](
        out, num_out, target_probs.contiguous(), target_argmax.contiguous(), draft_tokens.contiguous(),
        num_draft.contiguous(), draft_probs.contiguous() if draft_probs is not None else target_probs,
        uniforms.contiguous(), noise.contiguous(), is_greedy.to(torch.int8).contiguous(),
        float(synthetic_rate or 0.0), k, vocab,
        HAS_DRAFT_PROBS=draft_probs is not None and k > 0, SYNTHETIC=synthetic_rate is not None,
        BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )
    return out, num_out
