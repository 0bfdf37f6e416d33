"""Rejection sampling in plain PyTorch: the reference the Triton kernel is tested against, and the CPU path.

Terms (per row b, k = num_draft[b] draft tokens x_1..x_k):
  accepted  - x_i kept: greedy rows need x_i == argmax p_i; sampled rows need u_i * q_i(x_i) < p_i(x_i),
              i.e. probability min(1, p/q); q is one-hot for deterministic proposers. The first rejection
              ends the chain.
  recovered - the token emitted at the first rejected position i, drawn from normalize(max(0, p_i - q_i))
              (greedy rows: argmax p_i).
  bonus     - the token emitted after all k are accepted, drawn from p_{k+1}.
Draws use the exponential race: argmax(weights / noise) with noise ~ Exp(1) samples weights / sum(weights)
without normalizing. In synthetic mode, x_i is accepted iff u_i < rate, whatever the token (benchmarks only).
"""

from __future__ import annotations

import torch


def rejection_sample_reference(
    target_probs: torch.Tensor,  # [B, K + 1, V] fp32, after temperature/top-k/top-p
    target_argmax: torch.Tensor,  # [B, K + 1] long
    draft_tokens: torch.Tensor,  # [B, K] long, -1 past num_draft
    num_draft: torch.Tensor,  # [B] long
    draft_probs: torch.Tensor | None,  # [B, K, V] fp32, or None for one-hot drafts
    uniforms: torch.Tensor,  # [B, K] fp32 in [0, 1)
    noise: torch.Tensor,  # [B, V] fp32 ~ Exp(1)
    is_greedy: torch.Tensor,  # [B] bool
    synthetic_rate: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns output tokens [B, K + 1] (-1 after the last emitted) and their count [B] (accepted + 1)."""
    rows, k = draft_tokens.shape
    positions = torch.arange(k, device=draft_tokens.device)
    safe = draft_tokens.clamp(min=0)
    p_x = target_probs[:, :k].gather(-1, safe[..., None])[..., 0]
    q_x = draft_probs.gather(-1, safe[..., None])[..., 0] if draft_probs is not None else torch.ones_like(p_x)
    if synthetic_rate is not None:
        accept = uniforms < synthetic_rate
    else:
        accept_sampled = (q_x > 0) & (p_x > uniforms * q_x)
        accept = torch.where(is_greedy[:, None], draft_tokens == target_argmax[:, :k], accept_sampled)
    accept &= positions[None, :] < num_draft[:, None]
    num_accepted = accept.to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]

    row_index = torch.arange(rows, device=draft_tokens.device)
    p_final = target_probs[row_index, num_accepted]  # [B, V]
    rejected_here = num_accepted < num_draft
    at = num_accepted.clamp(max=max(k - 1, 0))
    if draft_probs is not None and k > 0:
        q_final = draft_probs[row_index, at]
    else:
        q_final = torch.zeros_like(p_final)
        if k > 0:
            q_final.scatter_(1, safe[row_index, at][:, None], 1.0)
    q_final = q_final * rejected_here[:, None]  # the bonus position has no draft to subtract
    residual = (p_final - q_final).clamp(min=0)
    # Only synthetic rejections can leave no residual mass; fall back to p itself then.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_final)
    recovered = (residual / noise).argmax(dim=-1)
    final = torch.where(is_greedy, target_argmax[row_index, num_accepted], recovered)

    out = torch.where(positions[None, :] < num_accepted[:, None], draft_tokens, torch.full_like(draft_tokens, -1))
    out = torch.cat([out, torch.full_like(out[:, :1], -1)], dim=1)
    out[row_index, num_accepted] = final
    return out, num_accepted + 1
