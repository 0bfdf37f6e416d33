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
    """Cuts each row's drafts (`drafts.counts`, in place) to its share of the best N -> the new counts. At most
    a few dozen chances: ranked on the host, one copy each way (ranked with tensor ops, the cut took a tenth of
    a millisecond of a one-row step's host work)."""
    survival = drafts.confidence[:rows].tolist()
    limits = drafts.counts[:rows].tolist()
    # every draft's chance, likeliest first; the sort is stable, so where a row's chances tie its chain's order
    # is kept and the N first are prefixes of the rows' chains
    ranked = sorted(((survival[b][j], b) for b in range(rows) for j in range(limits[b])), key=lambda c: -c[0])
    best, best_rate = 0, rows / (sunk_seconds + cost.forward(rows, 1) + cost.host(rows, False))
    gained, host = 0.0, cost.host(rows, True)
    for n, (chance, _) in enumerate(ranked, 1):
        gained += chance
        rate = (rows + gained) / (sunk_seconds + cost.forward(rows, 1 + n / rows) + host)
        if rate > best_rate:
            best, best_rate = n, rate
    counts = [0] * rows
    for _, b in ranked[:best]:
        counts[b] += 1
    drafts.counts[:rows] = torch.tensor(counts, dtype=drafts.counts.dtype, device=drafts.counts.device)
    return counts
