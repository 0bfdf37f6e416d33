"""PARD's training: conditional drop-token (COD) cross-entropy over the real tokens and K - 1 depths of mask
tokens (`draftsmith.methods.draft_model.head`), and a simulated acceptance against the frozen target for k = 1..K."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.methods.draft_model.head import IGNORE, cod_attention, cod_layout

# the acceptance eval drafts from every EVAL_STRIDE-th position: all K depths at every position would make
# its layout K times the sequence
EVAL_STRIDE = 4


def _lengths(batch) -> list[int]:
    return batch["lengths"].tolist()


def pard_objective(head, target, batch, features, cfg):
    """Mean cross-entropy of every kept token's next-token prediction (real tokens: depth 0, the draft's usual
    job; masks: depth i predicts the token i + 1 past its chain's last real one), against the data's tokens
    (target-regenerated text: the target's own continuations)."""
    layout = cod_layout(batch["input_ids"].cpu(), _lengths(batch), batch["loss_mask"].cpu(), head.config.pard_token,
                        cfg.parallel_draft_tokens, cfg.cod_retention, cfg.cod_min_retention)
    device = batch["input_ids"].device
    out = head(layout.input_ids.to(device), positions=layout.positions.to(device),
               attention_mask=layout.attention_mask.to(device))
    labels = layout.labels.to(device)
    # summed over the labelled tokens and divided by at least one: a batch with none (prompt tokens only)
    # trains nothing instead of a NaN mean
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    loss = loss / (labels != IGNORE).sum().clamp(min=1)
    logs = {}
    with torch.no_grad():
        hits = out.logits.argmax(-1) == labels
        depths = layout.depths.to(device)
        for depth in range(cfg.parallel_draft_tokens):
            where = (depths == depth) & (labels != IGNORE)
            if where.any():
                logs[f"top1_depth{depth}"] = hits[where].float().mean().item()
    return loss, logs


@torch.no_grad()
def simulated_acceptance(head, target, batch, features, max_k: int):
    """(accepted chains per depth [max_k], chain starts). From every EVAL_STRIDE-th position a (the last real
    token) the draft predicts tokens a+1..a+max_k in one forward (depth 0 and max_k - 1 masks); draft j is
    accepted if drafts 1..j all equal the target's greedy choice given the text so far (the text, not the drafts:
    exact where the text is the target's greedy continuation, as regenerated data is)."""
    ids, lengths = batch["input_ids"], _lengths(batch)
    device = ids.device
    greedy = target(ids).logits.argmax(-1)  # [B, L]: the target's choice for the token after each position
    counts, starts = torch.zeros(max_k, dtype=torch.long), 0
    for b, length in enumerate(lengths):
        anchors = torch.arange(0, length - max_k, EVAL_STRIDE)
        if not len(anchors):
            continue
        layout = _eval_layout(ids[b, :length].cpu(), anchors, max_k, head.config.pard_token)
        out = head(layout["ids"].to(device), positions=layout["positions"].to(device),
                   attention_mask=layout["mask"].to(device))
        drafts = out.logits[0].argmax(-1)[layout["draft_index"].to(device)]  # [anchors, max_k]
        wanted = greedy[b][(anchors[:, None] + torch.arange(max_k)[None]).to(device)]
        chain = (drafts == wanted).long().cumprod(1)
        counts += chain.sum(0).cpu()
        starts += len(anchors)
    return counts, starts


def _eval_layout(ids: torch.Tensor, anchors: torch.Tensor, max_k: int, pard_token: int) -> dict:
    """One row: the real tokens, then for each anchor a the masks of depths 1..max_k-1 at a+1..a+max_k-1;
    `draft_index[n, j]`: the token whose output is draft j + 1 of anchor n."""
    length = len(ids)
    masks = max_k - 1
    mask_pos = (anchors[:, None] + torch.arange(1, max_k)[None]).flatten()
    mask_depth = torch.arange(1, max_k).repeat(len(anchors))
    positions = torch.cat([torch.arange(length), mask_pos])
    depths = torch.cat([torch.zeros(length, dtype=torch.long), mask_depth])
    tokens = torch.cat([ids, torch.full((len(mask_pos),), pard_token)])
    draft_index = torch.cat([anchors[:, None],
                             length + torch.arange(len(anchors))[:, None] * masks + torch.arange(masks)[None]], 1)
    mask = cod_attention(positions[None], depths[None])
    return {"ids": tokens[None], "positions": positions[None], "mask": mask, "draft_index": draft_index}
