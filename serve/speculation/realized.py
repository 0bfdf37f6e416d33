"""Whether speculating, as the policy has been doing it, really ran faster than plain decoding would have: a
check on the plans by what steady speculative steps yielded (`RealizedSpeed`).

The planner picks the width its model predicts fastest, and its predictions lean optimistic exactly where
speculation is rare: a plan is made when its estimate came out high (the best of noisy estimates), the
acceptance rates are read OPTIMISM standard errors high, and what speculative steps were found to cost
fades over plain steps toward the model's parts (docs/decisions/adaptive-speculation.md has the
measurements).

So each steady speculative step is also judged by its result: its tokens per second over what plain
decoding is priced at now for as many rows (the cost model's plain price, learned from plain steps). Per
batch size (powers of two, as the cost model's scales), the decayed mean of those speeds and its standard
error give a verdict: speculating loses where the mean is below 1 by more than ARM_Z standard errors, on at
least MIN_STEPS steps. A step's speed is bounded below by 0, so one stalled step moves the mean by at most
1/n. A losing verdict holds every plan plain (probes still run, and their steady steps are judged too) for
as long as the mean stays LIFT_Z standard errors below 1. Plain steps fade the evidence's weight, not its
mean nor its spread, so the error widens until the verdict lifts: at a weight of (LIFT_Z x spread /
(1 - mean))^2, a quarter of what gave it for a loss just at ARM_Z, and less the clearer the loss (a mean of
0.5 with a spread of 0.2: 500-odd plain steps on). The next few losing steps renew it. No verdict outlasts
its evidence: one given while the plain price was stale (the machine slowed while every step speculated, so
no plain step re-priced decoding) is retried once the held plain steps have re-priced it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A losing verdict needs the mean speed ARM_Z standard errors under plain decoding's, and lasts while it is
# LIFT_Z under: at a steady mean, until the evidence has faded to (LIFT_Z / ARM_Z)^2 of its weight
ARM_Z, LIFT_Z = 2.0, 1.0
MIN_STEPS = 4.0  # no verdict is given on fewer (decayed) steady speculative steps
STEP_DECAY = 0.97  # per step observed at the batch size: the last 30-odd steps count
IDLE_DECAY = 0.99  # per plain step, the evidence's weight (not its mean) fades


@dataclass
class _Speeds:
    """Decayed sums over the steady speculative steps of one batch size: each step's speed is its tokens/s over
    plain decoding's."""

    n: float = 0.0  # weight of the steps behind the sums, faded by plain steps
    steps: float = 0.0  # the same steps' weight unfaded: the sample variance's count, which fading leaves alone
    speed_sum: float = 0.0
    speed_sq_sum: float = 0.0
    losing: bool = False

    def add(self, speed: float) -> None:
        self.n = STEP_DECAY * self.n + 1
        self.steps = STEP_DECAY * self.steps + 1
        self.speed_sum = STEP_DECAY * self.speed_sum + speed
        self.speed_sq_sum = STEP_DECAY * self.speed_sq_sum + speed * speed

    def fade(self, factor: float) -> None:
        self.n, self.speed_sum, self.speed_sq_sum = factor * self.n, factor * self.speed_sum, factor * self.speed_sq_sum

    def mean(self) -> float:
        return self.speed_sum / self.n

    def standard_error(self) -> float:
        """Of the mean: the steps' sample variance (fading keeps it) over their faded weight, so the error
        widens without bound as plain steps go by."""
        mean = self.mean()
        spread = max(self.speed_sq_sum / self.n - mean * mean, 0.0)
        variance = spread * self.steps / max(self.steps - 1, 1.0)
        return math.sqrt(variance / self.n)


class RealizedSpeed:
    """Steady speculative steps' speed over plain decoding's, per batch size, and the verdict it gives."""

    def __init__(self):
        self._by_rows: dict[int, _Speeds] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return max(rows, 1).bit_length()

    def observe(self, rows: int, tokens: int, seconds: float, plain_step_seconds: float) -> None:
        """A steady speculative step of `rows` rows gave `tokens` tokens in `seconds`, where a plain step of
        those rows is priced at `plain_step_seconds` (one token a row)."""
        if seconds <= 0 or plain_step_seconds <= 0 or tokens <= 0:
            return
        speeds = self._by_rows.setdefault(self.bucket(rows), _Speeds())
        speeds.add(tokens / rows * plain_step_seconds / seconds)

    def idle(self, steps: int = 1) -> None:
        """`steps` plain steps went by: the evidence weighs less (IDLE_DECAY), its mean is kept."""
        factor = IDLE_DECAY**steps
        for speeds in self._by_rows.values():
            speeds.fade(factor)

    def ratio(self, rows: int) -> float | None:
        """The mean speed of speculative steps at this batch size lately, over plain decoding's; None: none
        seen, or their weight faded to nothing."""
        speeds = self._by_rows.get(self.bucket(rows))
        return speeds.mean() if speeds is not None and speeds.n > 1e-9 else None

    def loses(self, rows: int) -> bool:
        """Whether speculating at this batch size has lately run slower than plain decoding, by the evidence:
        given at ARM_Z standard errors on MIN_STEPS steps or more, kept while LIFT_Z holds (this call updates
        the verdict)."""
        speeds = self._by_rows.get(self.bucket(rows))
        if speeds is None or speeds.n <= 1e-9 or (not speeds.losing and speeds.n < MIN_STEPS):
            return False
        z = LIFT_Z if speeds.losing else ARM_Z
        speeds.losing = speeds.mean() + z * speeds.standard_error() < 1.0
        return speeds.losing
