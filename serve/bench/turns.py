"""The order in which the bench's methods take their turns (`matrix.drive`).

A turn's first steps run on the caches the turn before left: in a fixed order the n-gram planner and a fixed
k choosing the same widths ran 6-7% apart with the fixed k second and 1% apart with it first (demo, one in
flight). Orders drawn at random from one seed left that to chance, the same chance in every run: over 120
rounds seven methods followed each other 11-28 times a pair, and 15-21 turns followed their own method. So
each round of turns is built to even out who follows whom: every live method once, each next one the method
that has followed the last turn's method least often (ties drawn from a fixed seed, so a run repeats), never
the same method twice in a row while another is live. Measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

TURN_ORDER_SEED = 0  # breaks ties between equally balanced choices: the same orders in every run


class TurnOrders:
    """Rounds of turns over whichever methods are still live, keeping count of which followed which."""

    def __init__(self, seed: int = TURN_ORDER_SEED):
        self._rng = random.Random(seed)
        self.follows: Counter = Counter()  # (before, after) -> turns `after` took right after `before`'s
        self._last = None

    def next_round(self, live: Sequence) -> list:
        """An order of `live` (each once) for the next round of turns; each turn is counted as taken."""
        left, order = list(live), []
        while left:
            choices = [run for run in left if run is not self._last] or left
            fewest = min(self.follows[(self._last, run)] for run in choices)
            pick = self._rng.choice([run for run in choices if self.follows[(self._last, run)] == fewest])
            if self._last is not None and pick is not self._last:
                self.follows[(self._last, pick)] += 1
            order.append(pick)
            left.remove(pick)
            self._last = pick
        return order
