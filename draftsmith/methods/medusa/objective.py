"""Medusa-1 training: head i at position t learns the target's distribution of token t + 2 + i (the target's
own softmax at position t + 1 + i), by soft cross-entropy, weighted decay**i (Medusa's 0.8); and the
teacher-forced chain acceptance the trainer reports: draft i from position t survives while it and every
draft before it equal the target's greedy token there."""

from __future__ import annotations

import torch

from draftsmith.methods.eagle.training import soft_ce, target_logits, top1_agreement
from draftsmith.methods.served_walk import walk_rows


def medusa_objective(head, target, batch, feats, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    last, loss_mask = feats["last"], batch["loss_mask"]
    width = last.shape[1]
    teacher = target_logits(target, last).softmax(-1)  # token t + 1's distribution at t
    logits = head(last.to(next(head.parameters()).dtype))  # [B, T, K, V]
    total, logs = 0.0, {}
    for i in range(head.config.num_heads):
        ahead = 1 + i
        if ahead >= width:
            break
        mask = loss_mask[:, ahead:].float()  # the teacher's position, as the EAGLE objectives mask it
        loss = soft_ce(logits[:, : width - ahead, i], teacher[:, ahead:], mask)
        total = total + cfg.head_decay**i * loss
        logs[f"loss_head{i}"] = loss.item()
        logs[f"acc_head{i}"] = top1_agreement(logits[:, : width - ahead, i], teacher[:, ahead:], mask)
    return total, logs


@torch.no_grad()
def simulated_acceptance(head, target, batch, feats, max_k: int) -> tuple[torch.Tensor, int, int, int]:
    last, loss_mask = feats["last"], batch["loss_mask"]
    depth = min(max_k, head.config.num_heads)
    width = last.shape[1]
    greedy = target_logits(target, last).argmax(-1)  # [B, T]: token t + 1 at t
    drafted = head(last.to(next(head.parameters()).dtype), heads=depth).argmax(-1)  # [B, T, depth]
    starts = (loss_mask[:, 1:] > 0)[:, : width - depth]
    alive = starts.clone()
    lengths = torch.zeros_like(starts, dtype=torch.long)  # the accepted drafts of the chain from each position
    counts = torch.zeros(max_k, dtype=torch.long)  # past the last head nothing is drafted: 0
    for i in range(depth):
        alive &= drafted[:, : width - depth, i] == greedy[:, 1 + i : width - depth + 1 + i]
        counts[i] = alive.sum()
        lengths += alive
    return counts, int(starts.sum()), *walk_rows(lengths, starts)
