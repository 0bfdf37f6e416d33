"""Training pieces the EAGLE family shares: the training-time-test unroll, the soft cross-entropy and top-1
agreement the losses report, and the teacher-forced simulated acceptance the trainer's eval runs.

Alignment: at position t the head reads the target feature at t and the token t+1, and predicts token
t+2, whose target distribution is softmax(lm_head(final hidden at t+1)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.methods.served_walk import walk_rows
from draftsmith.models.draft_layer import TTTHistory
from draftsmith.models.heads import RecurrentHead


def shift(x: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """x[:, s:] left-aligned, padded with `fill` to the same width."""
    if s == 0:
        return x
    pad = torch.full_like(x[:, :s], fill)
    return torch.cat([x[:, s:], pad], dim=1)


def unroll(head: RecurrentHead, input_ids: torch.Tensor, features: torch.Tensor, steps: int,
           anchors: torch.Tensor | None = None):
    """Yields (step, head logits [B, T-1, Vd]) for TTT steps 0..steps-1 over positions t = 0..T-2. Step s at
    position t drafts token t+2+s, attending to steps 0..s-1 of the same t (and step 0 before it). A P-EAGLE
    head (`parallel_drafting`) reads at steps s >= 1 not its own output and token t+1+s but the slot token and
    `mask_hidden`: what its parallel slots hold when it serves. `anchors` [B, A] (ascending positions per row):
    steps s >= 1 run at those positions only and yield [B, A, Vd], each equal to the full unroll's logits there
    (step 0 runs everywhere: its keys are every later step's context)."""
    width = input_ids.shape[1] - 1
    hidden = features[:, :width].to(next(head.parameters()).dtype)
    positions = torch.arange(width, device=input_ids.device).expand(input_ids.shape[0], width)
    parallel = getattr(head.config, "parallel_drafting", False)
    history = TTTHistory(anchors, window_at_query=parallel)
    for s in range(steps):
        tokens, from_target = shift(input_ids[:, 1:], s), s == 0
        if s and anchors is not None:
            tokens = tokens.gather(1, anchors)
            if s == 1:
                hidden, positions = at_rows(hidden, anchors), anchors
        if parallel and s:
            tokens, hidden = head.parallel_inputs(input_ids.shape[0], positions.shape[1], input_ids.device)
            from_target = True
        hidden, logits = head.step(tokens, hidden, positions + s, from_target=from_target, ttt_history=history)
        yield s, logits


def at_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] at positions rows [B, A] -> [B, A, ...]."""
    index = rows.reshape(*rows.shape, *([1] * (x.dim() - 2))).expand(*rows.shape, *x.shape[2:])
    return x.gather(1, index)


def sample_anchors(mask: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """`count` positions per row [B, count], ascending, drawn uniformly from those where `mask` [B, T] is set
    (topped up with others where a row has fewer: their loss mask is zero)."""
    scores = torch.rand(mask.shape, device=mask.device, generator=generator) + (mask > 0)
    return scores.topk(min(count, mask.shape[1]), dim=1).indices.sort(dim=1).values


@torch.no_grad()
def target_logits(target, last: torch.Tensor) -> torch.Tensor:
    """The frozen target's next-token logits (fp32) from its final normed hidden states [..., H]."""
    return target.lm_head(last.to(target.lm_head.weight.dtype)).float()


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
def chain_lengths(head, input_ids: torch.Tensor, feats, target_next: torch.Tensor, max_k: int) -> torch.Tensor:
    """[B, T-1]: how many drafts of the teacher-forced chain from each position t (tokens t+2..t+1+max_k) equal
    the target's argmax before the first that does not; `target_next` [B, T-1] the target's argmax of token
    t+2 at t+1 (given the text)."""
    alive = torch.ones_like(target_next, dtype=torch.bool)
    lengths = torch.zeros_like(target_next)
    for s, logits in unroll(head, input_ids, feats["features"], max_k):
        alive &= head.to_target_ids(logits.argmax(-1)) == shift(target_next, s, -1)
        lengths += alive
    return lengths


@torch.no_grad()
def simulated_acceptance(head, target, batch, feats, max_k: int) -> tuple[torch.Tensor, int, int, int]:
    """Teacher-forced greedy chain acceptance: (accepted-chain counts per depth [max_k], the number of chain
    starts, and the tokens and steps of the walks a server drafts along each row, `walk_rows`). A chain
    starting at t drafts tokens t+2.. and survives depth s while every draft so far equals the target's
    argmax."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    width = input_ids.shape[1] - 1
    target_next = target_logits(target, feats["last"][:, 1:]).argmax(-1)  # [B, T-1]
    starts = (loss_mask[:, 1:] > 0) & (torch.arange(width, device=input_ids.device)[None, :] < width - max_k)
    lengths = chain_lengths(head, input_ids, feats, target_next, max_k) * starts
    counts = torch.stack([(lengths > s).sum() for s in range(max_k)]).cpu()
    return counts, int(starts.sum()), *walk_rows(lengths, starts)
