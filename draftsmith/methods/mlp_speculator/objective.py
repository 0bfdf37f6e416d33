"""MLP speculator training: stage i at position t reads the target's final normed hidden state at t and the
token at t + 1 + i (teacher-forced: the text's, where serving feeds the previous stage's draft) and learns
token t + 2 + i, losses weighted decay**i. IBM trains in two stages, which `training.labels` selects: "text"
(stage 1, on plain text: cross-entropy against the text's own token t + 2 + i) and "target" (stage 2, on the
target's generations: soft cross-entropy against the target's distribution there, its softmax at t + 1 + i).
The demo recipe's data are the target's generations already, so its one "target" stage does both."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.methods.eagle.training import shift, soft_ce, target_logits, top1_agreement
from draftsmith.methods.served_walk import walk_rows


def _stage_inputs(head, feats, batch):
    """(hidden [B, W, H], tokens [B, W, n], W): every position t with the tokens of all n stages in the batch."""
    last, ids = feats["last"], batch["input_ids"]
    n = head.config.n_predict
    width = last.shape[1] - n
    tokens = torch.stack([ids[:, 1 + i : 1 + i + width] for i in range(n)], dim=-1)
    return last[:, :width].to(next(head.parameters()).dtype), tokens, width


def mlp_speculator_objective(head, target, batch, feats, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    hidden, tokens, width = _stage_inputs(head, feats, batch)
    if width <= 0:
        raise ValueError(f"samples of {feats['last'].shape[1]} tokens are too short for {head.config.n_predict} stages")
    by_text = cfg.labels == "text"
    teacher = None if by_text else target_logits(target, feats["last"]).softmax(-1)
    logits = head(hidden, tokens)  # [B, W, n, V]
    total, logs = 0.0, {}
    for i in range(head.config.n_predict):
        mask = batch["loss_mask"][:, 1 + i : 1 + i + width].float()
        if by_text:  # the text's token t + 2 + i; the last stage has none at the batch's last position
            labels = shift(batch["input_ids"], 2 + i)[:, :width]
            mask = mask * shift(batch["loss_mask"], 2 + i)[:, :width]
            ce = F.cross_entropy(logits[:, :, i].flatten(0, 1).float(), labels.flatten(), reduction="none")
            loss = (ce * mask.flatten()).sum() / mask.sum().clamp(min=1)
            hits = (logits[:, :, i].argmax(-1) == labels).float()
            logs[f"acc_stage{i}"] = ((hits * mask).sum() / mask.sum().clamp(min=1)).item()
        else:
            expected = teacher[:, 1 + i : 1 + i + width]
            loss = soft_ce(logits[:, :, i], expected, mask)
            logs[f"acc_stage{i}"] = top1_agreement(logits[:, :, i], expected, mask)
        total = total + cfg.stage_decay**i * loss
        logs[f"loss_stage{i}"] = loss.item()
    return total, logs


@torch.no_grad()
def simulated_acceptance(head, target, batch, feats, max_k: int) -> tuple[torch.Tensor, int, int, int]:
    """Teacher-forced greedy chains, as the EAGLE family's eval: each stage reads the text's token, and stage
    i's draft survives while it and every draft before it equal the target's greedy token there."""
    hidden, tokens, width = _stage_inputs(head, feats, batch)
    greedy = target_logits(target, feats["last"]).argmax(-1)  # token t + 1 at t
    depth = min(max_k, head.config.n_predict)
    drafted = head(hidden, tokens, stages=depth).argmax(-1)  # [B, W, depth]
    starts = batch["loss_mask"][:, 1 : 1 + width] > 0
    alive = starts.clone()
    lengths = torch.zeros_like(starts, dtype=torch.long)  # the accepted drafts of the chain from each position
    counts = torch.zeros(max_k, dtype=torch.long)  # past the last stage nothing is drafted: 0
    for i in range(depth):
        alive &= drafted[..., i] == greedy[:, 1 + i : 1 + i + width]
        counts[i] = alive.sum()
        lengths += alive
    return counts, int(starts.sum()), *walk_rows(lengths, starts)
