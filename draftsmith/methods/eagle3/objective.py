"""EAGLE-3 objective: training-time test unrolled `ttt_length` steps; step s feeds the head its own step s-1
output and the teacher-forced token t+1+s at rope position t+s, with the diagonal attention of
`draft_layer`; loss at each step is soft CE against the target distribution restricted (and renormalized)
to the draft vocab, skipping positions whose target argmax is outside it; steps are weighted decay**s. With
`num_anchors`, steps after the first train at that many positions a sequence (drawn where step 1 has a loss):
step 0 still runs over every position, since its keys are the later steps' context."""

from __future__ import annotations

import torch

from draftsmith.methods.eagle.training import (
    at_rows,
    sample_anchors,
    shift,
    soft_ce,
    target_logits,
    top1_agreement,
    unroll,
)


def eagle3_objective(head, target, batch, feats, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    width = input_ids.shape[1] - 1
    with torch.no_grad():
        teacher = target_logits(target, feats["last"][:, 1:])  # [B, T-1, V]
        in_vocab = head.t2d[teacher.argmax(-1)]
        teacher_p = teacher[..., head.t2d].softmax(-1)  # draft ids ascend like target ids: same order
    valid = torch.arange(width, device=input_ids.device)[None, :]
    masks = [(shift(loss_mask[:, 1:], s) * shift(in_vocab, s, False) * (valid < width - s)).float()
             for s in range(cfg.ttt_length)]
    anchors = sample_anchors(masks[1], cfg.num_anchors) if cfg.num_anchors and cfg.ttt_length > 1 else None
    total, logs = 0.0, {}
    for s, logits in unroll(head, input_ids, feats["features"], cfg.ttt_length, anchors):
        mask, teacher = masks[s], shift(teacher_p, s)
        if s and anchors is not None:
            mask, teacher = at_rows(mask, anchors), at_rows(teacher, anchors)
        loss = soft_ce(logits, teacher, mask)
        total = total + cfg.ttt_step_decay**s * loss
        logs[f"loss_step{s}"] = loss.item()
        logs[f"acc_step{s}"] = top1_agreement(logits, teacher, mask)
    return total, logs
