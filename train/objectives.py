"""What the training objectives of EAGLE-style heads share, and the simulated-acceptance eval.

Alignment (every such head): at position t the head reads the target feature at t and the token t+1, and
predicts token t+2, whose target distribution is softmax(lm_head(final hidden at t+1)). Each method's own
loss lives in its folder (`draftsmith/methods/<name>/objective.py`) and is built from these pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.models.heads import DraftHead


def target_features(target, aux_layer_ids: tuple[int, ...], input_ids: torch.Tensor,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The frozen target's features (aux layers, concatenated) and final normed hidden, stored as `dtype`."""
    last_id = target.config.num_hidden_layers
    with torch.no_grad():
        out = target(input_ids, hidden_layer_ids=set(aux_layer_ids) | {last_id}, compute_logits=False)
    # Rounding to the storage dtype here makes online batches equal to offline (captured) ones.
    features = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1).to(dtype)
    return {"features": features, "last": out.hidden_states[last_id].to(dtype)}


def shift(x: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """x[:, s:] left-aligned, padded with `fill` to the same width."""
    if s == 0:
        return x
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([x[:, s:], pad], dim=1)


def unroll(head: DraftHead, input_ids: torch.Tensor, features: torch.Tensor, steps: int):
    """Yields (step, head logits [B, T-1, Vd]) for TTT steps 0..steps-1 over positions t = 0..T-2."""
    width = input_ids.shape[1] - 1
    hidden = features[:, :width].to(next(head.parameters()).dtype)
    positions = torch.arange(width, device=input_ids.device).expand(input_ids.shape[0], width)
    history: list = []
    for s in range(steps):
        tokens = shift(input_ids[:, 1:], s)
        hidden, logits = head.step(tokens, hidden, positions + s, from_target=(s == 0), ttt_history=history)
        yield s, logits


def soft_ce(logits: torch.Tensor, teacher_p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ce = -(teacher_p * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return (ce * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def top1_agreement(logits: torch.Tensor, teacher_p: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of masked positions where the head's argmax is the teacher's: the number acceptance follows,
    which the loss hides when the teacher is high-entropy."""
    hits = (logits.argmax(-1) == teacher_p.argmax(-1)).float()
    return ((hits * mask).sum() / mask.sum().clamp(min=1)).item()




@torch.no_grad()
def simulated_acceptance(head, target, batch, feats, max_k: int) -> tuple[torch.Tensor, int]:
    """Teacher-forced greedy chain acceptance: returns accepted-chain counts per depth [max_k] and the
    number of chain starts. A chain starting at t drafts tokens t+2.. and survives depth s while every
    draft so far equals the target's argmax."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    width = input_ids.shape[1] - 1
    target_next = target.lm_head(feats["last"][:, 1:].to(target.lm_head.weight.dtype)).argmax(-1)  # [B, T-1]
    starts = (loss_mask[:, 1:] > 0) & (torch.arange(width, device=input_ids.device)[None, :] < width - max_k)
    alive = starts.clone()
    counts = torch.zeros(max_k, dtype=torch.long)
    for s, logits in unroll(head, input_ids, feats["features"], max_k):
        drafted = head.to_target_ids(logits.argmax(-1))
        alive &= drafted == shift(target_next, s, -1)
        counts[s] = alive.sum()
    return counts, int(starts.sum())


def acceptance_report(counts: torch.Tensor, starts: int) -> dict[str, float]:
    """Per-depth acceptance rates and mean acceptance length (1 + sum of rates) for k = 1..len(counts)."""
    rates = (counts.double() / max(starts, 1)).tolist()
    report = {f"sim_accept_pos{s + 1}": r for s, r in enumerate(rates)}
    for k in range(1, len(rates) + 1):
        report[f"sim_mean_acceptance_length_k{k}"] = 1 + sum(rates[:k])
    return report
