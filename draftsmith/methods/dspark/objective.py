"""DSpark training, DeepSpec's objective: blocks from random anchors as DFlash trains them (anchor-first),
each block position's logits with the Markov term of the true token before it (teacher forcing: the drafts a
served block accepts are those tokens), and per position, weighted exp(-(j - 1) / gamma) over the valid prefix
of the block:

    ce_weight * CE(draft, target's greedy token) + tv_weight * ||p_draft - p_target||_1
        + kd_weight * CE(draft, p_target) + confidence_weight * BCE(confidence logit, label)

The kd term (draftsmith's, off by default) is DFlash's distillation loss, the cross-entropy against the
target's whole distribution: its gradient keeps pulling where TV's has flattened out, which is what a head
trained for minutes rather than epochs needs.

The label is the chance the position is accepted given the ones before it: `match` (the default), 1 where the
draft's argmax is the target's, what greedy verification accepts; `tv`, DeepSpec's 1 - TV(p_draft, p_target),
what rejection sampling at temperature 1 accepts. Both are taken from the Markov-corrected draft."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.methods.dflash.objective import (
    _block_teacher,
    learned_positions,
    position_accuracy,
    sample_anchors,
    trained_positions,
)
from draftsmith.methods.dflash.objective import simulated_acceptance as dflash_simulated_acceptance
from draftsmith.methods.fused_soft_ce import fused_soft_ce


def _teacher_forced(head, batch, features, anchors, drafts: int):
    """Teacher-forced blocks from `anchors` [B, A]: (final hidden states [B, A, n, H], the positions
    predicted [B, A, n], whether each is a real token, the tokens before them (what the Markov term reads),
    the target's final normed hidden states that predict them [B, A, n, H])."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    hidden = head.training_forward(features["features"], ids, anchors, drafts).view(rows, anchors.shape[1], drafts, -1)
    predicted, real, teacher = _block_teacher(batch, features, anchors, drafts)
    previous = ids.gather(1, (predicted - 1).clamp(max=length - 1).view(rows, -1)).view(predicted.shape)
    return hidden, predicted, real, previous, teacher


@torch.no_grad()
def _target_logits(target, teacher: torch.Tensor) -> torch.Tensor:
    return target.lm_head(teacher.to(target.lm_head.weight.dtype)).float()


def block_outputs(head, target, batch, features, anchors, drafts: int):
    """Teacher-forced blocks from `anchors` [B, A]: (draft logits with the Markov term [B, A, n, V], final
    hidden states [B, A, n, H], Markov embeddings of the tokens before each position or None, the target's
    logits [B, A, n, V], the positions predicted [B, A, n] and whether each is a real token)."""
    hidden, predicted, real, previous, teacher = _teacher_forced(head, batch, features, anchors, drafts)
    target_logits = _target_logits(target, teacher)
    embedded, bias = head.markov(previous, hidden)
    return head.readout(hidden) + bias, hidden, embedded, target_logits, predicted, real


def dspark_objective(head, target, batch, features, cfg):
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    learned, decay = learned_positions(head, cfg, ids.device)
    anchors, valid = sample_anchors(loss_mask, batch["lengths"].tolist(), cfg.num_anchors, ids.device)
    hidden, predicted, real, previous, teacher = _teacher_forced(head, batch, features, anchors, learned)
    # a block's valid prefix: a position past a gap is never verified
    trained = trained_positions(batch, valid, predicted, real).long().cumprod(-1).bool()
    weights = trained.float() * decay
    total = weights.sum().clamp(min=1e-6)
    if cfg.tv_weight or cfg.confidence_label == "tv":
        embedded, bias = head.markov(previous, hidden)
        logits = head.readout(hidden) + bias
        target_logits = _target_logits(target, teacher)
        greedy = target_logits.argmax(-1)
        per_position, l1 = _distillation(logits, target_logits, greedy, cfg)
        loss = (per_position * weights).sum() / total
        hits = logits.argmax(-1) == greedy
    else:  # what the kd and ce terms read, fused with the LM head and the Markov GEMM
        markov = head.markov_head
        embedded = markov.embed(previous) if markov is not None else None
        loss, drafted, greedy = fused_soft_ce(hidden, teacher, head.target.lm_head.weight, weights / total,
                                              kd=cfg.kd_weight, ce=cfg.ce_weight,
                                              markov=markov.latent(embedded, hidden) if markov is not None else None,
                                              markov_weight=markov.markov_w2.weight if markov is not None else None)
        hits, l1 = drafted == greedy, None
    with torch.no_grad():
        logs = position_accuracy(hits, trained)
    if head.confidence_head is not None:
        label = hits.float() if cfg.confidence_label == "match" else (1 - l1 / 2).clamp(0, 1)
        confidence = head.confidence_logits(hidden, embedded)
        bce = F.binary_cross_entropy_with_logits(confidence, label.detach(), reduction="none")
        loss = loss + cfg.confidence_weight * (bce * weights).sum() / total
        with torch.no_grad():
            where = trained[:, :, 0]
            if where.any():
                logs["conf_pos1"] = torch.sigmoid(confidence[:, :, 0][where]).mean().item()
    return loss, logs


def _distillation(logits, target_logits, greedy, cfg) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each position's weighted ce + tv + kd terms, and the L1 distance where a term or the label reads it).
    A term of weight 0 is not computed: each is a few passes over [positions, vocabulary] values, forward and
    backward, which is most of what a step's loss costs on a CPU."""
    log_draft = torch.log_softmax(logits, -1)
    per_position = torch.zeros_like(greedy, dtype=log_draft.dtype)
    if cfg.ce_weight:
        per_position = per_position - cfg.ce_weight * log_draft.gather(-1, greedy[..., None])[..., 0]
    l1 = None
    if cfg.tv_weight or cfg.kd_weight or cfg.confidence_label == "tv":
        p_target = torch.softmax(target_logits, -1)
        if cfg.kd_weight:
            per_position = per_position - cfg.kd_weight * (p_target * log_draft).sum(-1)
        if cfg.tv_weight or cfg.confidence_label == "tv":
            l1 = (log_draft.exp() - p_target).abs().sum(-1)
            per_position = per_position + cfg.tv_weight * l1
    return per_position, l1


def block_chains(head, target, batch, features, anchors, max_k: int) -> torch.Tensor:
    """[B, A, max_k]: 1 where the block from each anchor has drafts 1..j all equal to the target's greedy
    choices given the text. The Markov term reads the text's tokens: along an accepted prefix those are the
    drafts, so the count is what a served block drafting greedily would accept."""
    logits, _, _, target_logits, _, _ = block_outputs(head, target, batch, features, anchors, max_k)
    return (logits.argmax(-1) == target_logits.argmax(-1)).long().cumprod(-1)


@torch.no_grad()
def simulated_acceptance(head, target, batch, features, max_k: int):
    """DFlash's simulated acceptance (`methods.dflash.objective.simulated_acceptance`) of DSpark blocks."""
    return dflash_simulated_acceptance(head, target, batch, features, max_k, chains=block_chains)
