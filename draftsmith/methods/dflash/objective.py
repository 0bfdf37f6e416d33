"""DFlash training: blocks from random anchors along each sequence, draft j of each block (block position j in
the 1+N layout, j - 1 anchor-first) learning the target's distribution of the token at anchor + j
(soft cross-entropy, weighted exp(-(j - 1) / gamma)), and the simulated acceptance of whole blocks against
the target's greedy choices."""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.fused_soft_ce import fused_soft_ce
from draftsmith.methods.served_walk import served_walk

EVAL_STRIDE = 4  # the per-depth acceptance eval counts the block from every EVAL_STRIDE-th anchor choice
# blocks a row's eval drafts in one forward: each block attends over the row's every block (masked), so a long
# row's hundreds of blocks at once would cost memory quadratic in them
EVAL_BLOCKS = 128


def anchor_choices(loss_mask: torch.Tensor, length: int) -> torch.Tensor:
    """A row's positions a in [1, length - 2] (a block needs context before it and a token after its anchor)
    whose next token is learned: a block drafts where it predicts trained tokens (with `data.mask_prompt`,
    the regenerated part: where it drafts when it serves)."""
    return (loss_mask[2:length].nonzero()[:, 0] + 1).cpu() if length > 2 else torch.zeros(0, dtype=torch.long)


def sample_anchors(loss_mask: torch.Tensor, lengths: list[int], count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A], valid [B, A]): per row up to `count` distinct `anchor_choices`, drawn at random; short
    rows repeat their first anchor with valid False."""
    anchors = torch.ones(len(lengths), count, dtype=torch.long)
    valid = torch.zeros(len(lengths), count, dtype=torch.bool)
    for b, length in enumerate(lengths):
        choices = anchor_choices(loss_mask[b], length)
        if not len(choices):
            continue
        picked = choices[torch.randperm(len(choices))[:count]]
        anchors[b, : len(picked)], valid[b, : len(picked)] = picked, True
        anchors[b, len(picked):] = picked[0]
    return anchors.to(device), valid.to(device)


def _block_teacher(batch, features, anchors, positions: int):
    """For block positions j = 1..positions of each anchor: the position whose token it predicts (anchor + j),
    whether that is a real token, and the target's final normed hidden state that predicts it (at anchor + j
    - 1) [B, A, positions, H]."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    lengths = batch["lengths"].to(ids.device)
    predicted = anchors[:, :, None] + torch.arange(1, positions + 1, device=ids.device)  # [B, A, positions]
    real = predicted < lengths[:, None, None]
    read_at = (predicted - 1).clamp(max=length - 1).view(rows, -1)
    last = features["last"].gather(1, read_at[:, :, None].expand(-1, -1, features["last"].shape[-1]))
    return predicted, real, last.view(*predicted.shape, -1)


def _block_targets(target, batch, features, anchors, positions: int):
    """`_block_teacher`'s positions, with the target's logits for them in place of its hidden states."""
    predicted, real, last = _block_teacher(batch, features, anchors, positions)
    with torch.no_grad():
        target_logits = target.lm_head(last.to(target.lm_head.weight.dtype)).float()
    return predicted, real, target_logits


def trained_positions(batch, valid, predicted, real) -> torch.Tensor:
    """[B, A, n]: the block positions the loss may train: a real token the loss mask keeps, of an anchor
    sampled (`valid` [B, A])."""
    loss_mask = batch["loss_mask"]
    rows, length = loss_mask.shape
    kept = loss_mask.gather(1, predicted.clamp(max=length - 1).view(rows, -1)).view(predicted.shape).bool()
    return real & valid[:, :, None] & kept


def learned_positions(head, cfg, device) -> tuple[int, torch.Tensor]:
    """(how many of a block's drafts the loss trains: training.loss_positions, else all the head drafts;
    their weights exp(-(j - 1) / loss_decay_gamma)). Later drafts weigh little but cost as much LM head as
    the first ones: they may sit out."""
    most = head.config.max_drafts()
    learned = cfg.loss_positions or most
    if learned > most:
        raise DraftsmithError(f"training.loss_positions {learned}: the head's block_size {head.config.block_size} "
                              f"drafts {most} positions; set loss_positions <= {most}")
    return learned, torch.exp(-torch.arange(learned, device=device, dtype=torch.float32) / cfg.loss_decay_gamma)


def position_accuracy(hits: torch.Tensor, trained: torch.Tensor) -> dict[str, float]:
    """acc_pos1..4: how often the block's first drafts are the target's greedy tokens, where trained. `hits`
    and `trained`: bool [rows, anchors, positions]."""
    logs = {}
    for j in range(min(hits.shape[-1], 4)):
        where = trained[:, :, j]
        if where.any():
            logs[f"acc_pos{j + 1}"] = hits[:, :, j][where].float().mean().item()
    return logs


def dflash_objective(head, target, batch, features, cfg):
    """The soft cross-entropy of each trained block position's draft against the target's distribution,
    weighted exp(-(j - 1) / gamma), fused with the LM head (`methods.fused_soft_ce`)."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    rows = ids.shape[0]
    learned, decay = learned_positions(head, cfg, ids.device)
    anchors, valid = sample_anchors(loss_mask, batch["lengths"].tolist(), cfg.num_anchors, ids.device)
    hidden = head.training_forward(features["features"], ids, anchors, learned)
    predicted, real, teacher = _block_teacher(batch, features, anchors, learned)
    trained = trained_positions(batch, valid, predicted, real)
    weights = trained.float() * decay
    loss, drafted, greedy = fused_soft_ce(hidden.view(rows, anchors.shape[1], learned, -1), teacher,
                                          head.target.lm_head.weight, weights / weights.sum().clamp(min=1e-6))
    with torch.no_grad():
        return loss, position_accuracy(drafted == greedy, trained)


@torch.no_grad()
def simulated_acceptance(head, target, batch, features, max_k: int, chains=None):
    """(accepted chains per depth [max_k], chain starts, served tokens, served blocks). Draft j of a block is
    accepted if drafts 1..j all equal the target's greedy choices given the text (given the text, not the
    drafts: exact where the text is the target's greedy continuation, as regenerated data is). The per-depth
    counts take a block from every EVAL_STRIDE-th anchor choice; the served pair walks each row as a server
    drafts it (`served_walk`): blocks drafted and the tokens they yield. `chains`: how a block's accepted
    chains are counted (`block_chains`, the default; a head built on DFlash passes its own)."""
    chains = chains or block_chains
    ids = batch["input_ids"]
    counts, starts = torch.zeros(max_k, dtype=torch.long), 0  # depths past the block stay 0: never drafted
    served_tokens = served_blocks = 0
    max_k = min(max_k, head.config.max_drafts())
    lengths = batch["lengths"].tolist()
    for b, length in enumerate(lengths):
        choices = anchor_choices(batch["loss_mask"][b], length)
        anchor_list = choices[choices < length - max_k].to(ids.device)
        if not len(anchor_list):
            continue
        row = {key: batch[key][b : b + 1] for key in ("input_ids", "loss_mask", "lengths")}
        feats = {key: value[b : b + 1] for key, value in features.items()}
        chain = torch.cat([chains(head, target, row, feats, anchors[None], max_k)[0]
                           for anchors in anchor_list.split(EVAL_BLOCKS)])
        counts[:max_k] += chain[::EVAL_STRIDE].sum(0).cpu()
        starts += len(chain[::EVAL_STRIDE])
        # a server's first token comes from the prompt's forward: its first block starts after that
        walk = served_walk(dict(zip(anchor_list.tolist(), chain.sum(-1).tolist())), anchor_list[0].item() + 1)
        served_tokens, served_blocks = served_tokens + sum(walk) + len(walk), served_blocks + len(walk)
    return counts, starts, served_tokens, served_blocks


def block_chains(head, target, batch, features, anchors, max_k: int) -> torch.Tensor:
    """[B, A, max_k]: 1 where the teacher-forced block from each anchor [B, A] has drafts 1..j all equal to the
    target's greedy choices given the text."""
    hidden = head.training_forward(features["features"], batch["input_ids"], anchors, max_k)
    drafts = head.readout(hidden.view(*anchors.shape, max_k, -1)).argmax(-1)
    _, _, target_logits = _block_targets(target, batch, features, anchors, max_k)
    return (drafts == target_logits.argmax(-1)).long().cumprod(-1)
