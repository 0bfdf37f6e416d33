"""How many of each row's chain drafts to verify, from the drafter's own confidence (DSpark's confidence head):
`DraftBatch.confidence[b, j]` is the chance that row b's drafts 0..j all survive verification, which falls
along a chain, so the N likeliest drafts of the whole batch are a prefix of each row's chain. Of those cuts
the engine takes the N that maximises the step's expected tokens per second,

    (rows + sum of the N likeliest survival chances) / (drafting + F(rows, 1 + N / rows) + host)

with F the cost model's verify forward of the rows' mean query length (rows of unequal lengths verify packed)
and drafting already spent. N = 0 verifies nothing: a plain step. Rows in a busy batch thus keep only the
drafts likely enough to pay for the tokens they add to the verify; alone, a row keeps more.

Drafters without a confidence are cut the same way by the policy's own chances (`size_chains_by_rates`): each
row's acceptance rates by position, as the plan priced them. A plan sets one width for the whole batch, and a
row whose drafts have lately been rejected verifies as many of them as the batch's best row; at 8 in flight,
where a verify forward's cost grows with every token it scores, those tokens are the ones that do not pay."""

from __future__ import annotations

import itertools
import operator

import torch


def size_chains(drafts, rows: int, cost, sunk_seconds: float) -> list[int]:
    """Cuts each row's drafts (`drafts.counts`, in place) to its share of the best N -> the new counts. At most
    a few dozen chances: ranked on the host, one copy each way (ranked with tensor ops, the cut took a tenth of
    a millisecond of a one-row step's host work)."""
    return _cut(drafts, rows, drafts.confidence[:rows].tolist(), cost, sunk_seconds)


def size_chains_by_rates(drafts, rows: int, rates: list[list[float]], cost, sunk_seconds: float) -> list[int]:
    """`size_chains` by the policy's chances: rates[b][j] is the chance row b's draft j is accepted given the
    ones before it were (`AdaptivePolicy.rates`), so the chance it survives is their running product."""
    return _cut(drafts, rows, [list(itertools.accumulate(row, operator.mul)) for row in rates], cost, sunk_seconds)


def _cut(drafts, rows: int, survival: list[list[float]], cost, sunk_seconds: float) -> list[int]:
    """Cuts each row's drafts to its share of the N likeliest by `survival[b][j]` (falling along each row) that
    maximise the step's expected tokens per second -> the new counts (also written into `drafts.counts`)."""
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
