"""The served walk: the steps a server drafts along a text, read off teacher-forced chains. An eval's
per-depth rates count a chain from every position, but a server drafts only from where its last step ended,
one past its last accepted draft: often right after a wrong one, where drafting is hard. The walk's tokens a
step are what serving yields on that text; the rates overstate it (the EAGLE-3 demo head at k = 3 on its
target's own greedy continuations: 2.97 from every position, 2.85 walked, 2.80 served).

Chains are indexed by their anchor, the last verified position whose target state the step reads (the
feature an EAGLE-style head reads, the block's first token for DFlash); a step that accepts n drafts moves
the anchor on by n + 1, to its last accepted draft (or the position before the bonus token)."""

from __future__ import annotations

import torch


def served_walk(accepted: dict[int, int], start: int) -> list[int]:
    """The accepted drafts of each step a server drafts from anchor `start` on, given each anchor's (`accepted`:
    anchor -> right drafts of its chain): step after step, each anchored where the last one's first wrong
    draft was (or one past a fully accepted chain), until an anchor without a chain."""
    walk, anchor = [], start
    while anchor in accepted:
        walk.append(accepted[anchor])
        anchor += accepted[anchor] + 1
    return walk


def walk_rows(chain_lengths: torch.Tensor, starts: torch.Tensor) -> tuple[int, int]:
    """(tokens, steps) of every row's served walks: `chain_lengths` [B, W] the accepted drafts of the chain
    anchored at each position, `starts` [B, W] where a chain may be anchored (learned text before the row's
    last max_k positions). A row is walked from its first start; past a gap (a prompt or a turn not learned)
    the walk starts again at the next start, as a server's next request would. Each step yields its accepted
    drafts and the target's own token."""
    tokens = steps = 0
    for lengths, where in zip(chain_lengths.tolist(), starts.tolist()):
        accepted = {t: n for t, (n, ok) in enumerate(zip(lengths, where)) if ok}
        anchor = min(accepted, default=None)
        while anchor is not None:
            walk = served_walk(accepted, anchor)
            tokens, steps = tokens + sum(walk) + len(walk), steps + len(walk)
            end = anchor + sum(walk) + len(walk)
            anchor = min((t for t in accepted if t > end), default=None)
    return tokens, steps
