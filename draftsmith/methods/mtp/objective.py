"""MTP objective: the layer applied recursively `ttt_length` steps (step s reads its own step s-1 output and
the token t+1+s, attending like a served draft through `draft_layer`'s TTT mask); each step's loss is soft
cross-entropy against the frozen target's distribution at that position, weighted by FastMTP's normalized
decay**s."""

from __future__ import annotations

import torch

from draftsmith.methods.eagle.training import shift, soft_ce, target_logits, top1_agreement, unroll


def step_weights(steps: int, decay: float) -> list[float]:
    raw = [decay**s for s in range(steps)]
    return [w / sum(raw) for w in raw]


def mtp_objective(head, target, batch, feats, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    width = input_ids.shape[1] - 1
    teacher_p = target_logits(target, feats["last"][:, 1:]).softmax(-1)  # [B, T-1, V]
    valid = torch.arange(width, device=input_ids.device)[None, :]
    total, logs = 0.0, {}
    for s, (weight, (_, logits)) in enumerate(zip(step_weights(cfg.ttt_length, cfg.step_decay),
                                                  unroll(head, input_ids, feats["features"], cfg.ttt_length))):
        mask = (shift(loss_mask[:, 1:], s) * (valid < width - s)).float()
        loss = soft_ce(logits, shift(teacher_p, s), mask)
        total = total + weight * loss
        logs[f"loss_step{s}"] = loss.item()
        logs[f"acc_step{s}"] = top1_agreement(logits, shift(teacher_p, s), mask)
    return total, logs
