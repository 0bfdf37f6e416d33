"""How many of each row's chain drafts to verify, from the drafter's own confidence (DSpark's confidence head):
`DraftBatch.confidence[b, j]` is the chance that row b's drafts 0..j all survive verification, which falls
along a chain, so the N likeliest drafts of the whole batch are a prefix of each row's chain. Of those cuts
the engine takes the N that maximises the step's expected tokens per second,

    (rows + sum of the N likeliest survival chances) / (drafting + F(rows, 1 + N / rows) + host)

with F the cost model's verify forward of the rows' mean query length (rows of unequal lengths verify packed)
and drafting already spent. N = 0 verifies nothing: a plain step. Rows in a busy batch thus keep only the
drafts likely enough to pay for the tokens they add to the verify; alone, a row keeps more."""

from __future__ import annotations

import torch


def size_chains(drafts, rows: int, cost, sunk_seconds: float) -> list[int]:
    """Cuts each row's drafts (`drafts.counts`, in place) to its share of the best N -> the new counts."""
    survival = drafts.confidence[:rows].float()
    limits = drafts.counts[:rows]
    drafted = torch.arange(survival.shape[1], device=survival.device)[None, :] < limits[:, None]
    chances = torch.where(drafted, survival, -1.0)
    ranked, order = chances.flatten().sort(descending=True)
    available = int(drafted.sum())
    gained = [0.0] + ranked[:available].double().cumsum(0).tolist()
    best, best_rate = 0, 0.0
    for n in range(available + 1):
        seconds = sunk_seconds + cost.forward(rows, 1 + n / rows) + cost.host(rows, n > 0)
        rate = (rows + gained[n]) / seconds
        if rate > best_rate:
            best, best_rate = n, rate
    kept = torch.zeros(rows * survival.shape[1], dtype=torch.long, device=survival.device)
    kept[order[:best]] = 1
    counts = kept.view(rows, -1).sum(-1)
    drafts.counts[:rows] = counts
    return counts.tolist()
