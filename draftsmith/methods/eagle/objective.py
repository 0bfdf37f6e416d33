"""EAGLE (-1/2) objective: one step; loss = feature_w * SmoothL1(pred, final hidden at t+1) + token_w * soft CE
against the target's distribution; uniform noise on the input features (EAGLE's regularizer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.methods.eagle.training import soft_ce, target_logits, top1_agreement


def eagle_objective(head, target, batch, feats, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    width = input_ids.shape[1] - 1
    dtype = next(head.parameters()).dtype
    last = feats["last"].to(dtype)
    inputs = last[:, :width]
    if cfg.noise_std > 0:  # EAGLE's uniform feature noise, on inputs only
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * cfg.noise_std
    positions = torch.arange(width, device=input_ids.device).expand(input_ids.shape[0], width)
    pred, logits = head.step(input_ids[:, 1:], inputs, positions, from_target=True)
    goal = last[:, 1:]
    mask = loss_mask[:, 1:].float()
    feature_loss = (F.smooth_l1_loss(pred.float(), goal.float(), reduction="none").mean(-1) * mask).sum() / mask.sum().clamp(min=1)
    teacher_p = target_logits(target, goal).softmax(-1)
    token_loss = soft_ce(logits, teacher_p, mask)
    total = cfg.feature_loss_weight * feature_loss + cfg.token_loss_weight * token_loss
    return total, {"feature_loss": feature_loss.item(), "token_loss": token_loss.item(),
                   "acc_step0": top1_agreement(logits, teacher_p, mask)}
