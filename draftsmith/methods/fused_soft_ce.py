"""The distillation loss of a head read out through the frozen target's LM head, fused with that LM head and
taken a chunk of rows at a time:

    loss = sum_r w_r * (kd * CE(p_target_r, q_r) + ce * CE(greedy_r, q_r)),
    q_r = softmax(hidden_r @ W^T + markov_r @ M^T),  p_target_r = softmax(teacher_r @ W^T)

where W is the target's LM head (frozen), `markov` / M an optional low-rank logit bias (DSpark's Markov head)
and greedy_r the target's argmax. The gradient of a row's logits is (kd + ce) q - kd p - ce onehot(greedy),
known in the forward pass, so each chunk's logits are made, used and dropped while they sit in cache instead
of the unfused loss's several passes (casts, softmaxes, products and their backwards) over [rows, vocabulary]
tensors from memory. Forward and backward in one pass, as Liger's fused linear cross-entropy does; the GEMMs
run in the autocast dtype where autocast is on, as the unfused loss's do, with softmaxes in fp32."""

from __future__ import annotations

import torch

CHUNK_ROWS = 128  # a chunk's fp32 logits of an 8192-token vocabulary: 4 MB


class _FusedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, teacher, weight, markov, markov_weight, row_weights, kd, ce, dtype):
        n = hidden.shape[0]
        w = weight.to(dtype)
        m_w = markov_weight.to(dtype) if markov is not None else None
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
        grad_markov = torch.empty(markov.shape, dtype=dtype, device=hidden.device) if markov is not None else None
        grad_markov_weight = torch.zeros(markov_weight.shape, dtype=torch.float32,
                                         device=hidden.device) if markov is not None else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        drafted = torch.empty(n, dtype=torch.long, device=hidden.device)
        greedy = torch.empty(n, dtype=torch.long, device=hidden.device)
        for start in range(0, n, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, n))
            h = hidden[rows].to(dtype)
            logits = (h @ w.t()).float()
            e = None
            if markov is not None:
                e = markov[rows].to(dtype)
                logits += (e @ m_w.t()).float()
            with torch.no_grad():
                teacher_logits = (teacher[rows].to(dtype) @ w.t()).float()
            drafted[rows], greedy[rows] = logits.argmax(-1), teacher_logits.argmax(-1)
            log_q = torch.log_softmax(logits, -1)
            del logits
            row_loss = torch.zeros(log_q.shape[0], dtype=torch.float32, device=hidden.device)
            p = torch.softmax(teacher_logits, -1) if kd else None
            picked = greedy[rows, None]
            if kd:
                row_loss -= kd * (p * log_q).sum(-1)
            if ce:
                row_loss -= ce * log_q.gather(-1, picked)[:, 0]
            grad = log_q.exp_().mul_(kd + ce)  # (kd + ce) q, in log q's place once the loss has read it
            if kd:
                grad.sub_(p, alpha=kd)
            if ce:
                grad.scatter_add_(-1, picked, torch.full(picked.shape, -ce, dtype=grad.dtype, device=grad.device))
            weights = row_weights[rows].float()
            loss += (row_loss * weights).sum()
            grad = grad.mul_(weights[:, None]).to(dtype)
            grad_hidden[rows] = grad @ w
            if markov is not None:
                grad_markov[rows] = grad @ m_w
                grad_markov_weight += (grad.t() @ e).float()
        ctx.save_for_backward(grad_hidden, grad_markov, grad_markov_weight)
        ctx.dtypes = (hidden.dtype, markov.dtype if markov is not None else None,
                      markov_weight.dtype if markov is not None else None)
        ctx.mark_non_differentiable(drafted, greedy)
        return loss, drafted, greedy

    @staticmethod
    def backward(ctx, grad_loss, _drafted, _greedy):
        grad_hidden, grad_markov, grad_markov_weight = ctx.saved_tensors
        hidden_dtype, markov_dtype, markov_weight_dtype = ctx.dtypes
        scale = grad_loss.float()
        out_hidden = (grad_hidden.float() * scale).to(hidden_dtype)
        out_markov = out_markov_weight = None
        if grad_markov is not None:
            out_markov = (grad_markov.float() * scale).to(markov_dtype)
            out_markov_weight = (grad_markov_weight * scale).to(markov_weight_dtype)
        return out_hidden, None, None, out_markov, out_markov_weight, None, None, None, None


def fused_soft_ce(hidden: torch.Tensor, teacher: torch.Tensor, lm_head: torch.Tensor, row_weights: torch.Tensor,
                  kd: float = 1.0, ce: float = 0.0, markov: torch.Tensor | None = None,
                  markov_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [..., H] (the head's final states), teacher [..., H] (the target's final normed states at the
    same positions), lm_head [V, H] (frozen), row_weights [...] (each row's share of the loss: weights over
    their sum), optional markov [..., r] and markov_weight [V, r] -> (the weighted loss, the drafts' argmax
    [...] and the target's [...]). Gradients reach hidden, markov and markov_weight."""
    if lm_head.requires_grad:
        raise ValueError("fused_soft_ce: the LM head is the frozen target's; it gets no gradient here")
    shape = hidden.shape[:-1]
    device = hidden.device.type
    # the GEMMs' dtype: autocast's where it is on, else the LM head's (as `lm_head(hidden.to(its dtype))`)
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else lm_head.dtype
    flat = (hidden.reshape(-1, hidden.shape[-1]), teacher.reshape(-1, teacher.shape[-1]).detach())
    m = markov.reshape(-1, markov.shape[-1]) if markov is not None else None
    with torch.autocast(device, enabled=False):
        loss, drafted, greedy = _FusedSoftCE.apply(*flat, lm_head.detach(), m, markov_weight,
                                                   row_weights.reshape(-1).detach(), float(kd), float(ce), dtype)
    return loss, drafted.view(shape), greedy.view(shape)
