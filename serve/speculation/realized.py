"""Whether speculating, as the policy has been doing it, really ran faster than plain decoding would have: a
check on the plans by what steady speculative steps yielded (`RealizedSpeed`).

The planner picks the width its model predicts fastest, and its predictions lean optimistic exactly where
speculation is rare: a plan is made when its estimate came out high (the best of noisy estimates), the
acceptance rates are read OPTIMISM standard errors high, and what speculative steps were found to cost
fades over plain steps toward the model's parts. A head that loses a little on every step it drafts (the
demo EAGLE head at one request in flight: 1.57 tokens predicted per step, 1.47 got; 8.9 ms, 9.1 got) then
speculates on about a third of its steps, each about 0.9x as fast as a plain one.

So each steady speculative step is also judged by its result: its tokens over its seconds, against what a
plain step of as many rows is priced at now (the cost model's plain price, learned from plain steps and
checked against them). Per batch size (powers of two, as the cost model's scales), the decayed mean of
those speeds and its standard error give a verdict: speculating loses where the mean is below 1 by more than
ARM_Z standard errors. A losing verdict holds every plan plain (probes still run, and their steady steps are
judged too) until the evidence has faded to where the mean is no longer LIFT_Z standard errors below 1:
fading keeps the mean and only widens its error, so a verdict lifts after some hundred plain steps and is
renewed by the next few losing steps, not re-learned from scratch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A losing verdict needs the mean speed ARM_Z standard errors under plain decoding's, and lasts while it is
# LIFT_Z under: the evidence must fade to a quarter before a verdict lifts (about 140 plain steps)
ARM_Z, LIFT_Z = 1.0, 0.5
MIN_STEPS = 4.0  # no verdict on fewer (decayed) steady speculative steps
STEP_DECAY = 0.97  # per step observed at the batch size: the last 30-odd steps count
IDLE_DECAY = 0.99  # per plain step, the evidence's weight (not its mean) fades


@dataclass
class _Speeds:
    """Decayed sums over the steady speculative steps of one batch size."""

    n: float = 0.0  # weight of the steps behind the sums
    plain_seconds: float = 0.0  # what plain decoding would have taken for their tokens
    seconds: float = 0.0  # what they took
    speed: float = 0.0  # sum of each step's speed over plain decoding's
    speed_sq: float = 0.0
    losing: bool = False

    def add(self, plain_seconds: float, seconds: float) -> None:
        speed = plain_seconds / seconds
        d = STEP_DECAY
        self.n, self.plain_seconds, self.seconds = d * self.n + 1, d * self.plain_seconds + plain_seconds, \
            d * self.seconds + seconds
        self.speed, self.speed_sq = d * self.speed + speed, d * self.speed_sq + speed * speed

    def fade(self, factor: float) -> None:
        self.n, self.plain_seconds, self.seconds = factor * self.n, factor * self.plain_seconds, factor * self.seconds
        self.speed, self.speed_sq = factor * self.speed, factor * self.speed_sq

    def ratio(self) -> float:
        """Tokens/s of the steps over plain decoding's for the same tokens."""
        return self.plain_seconds / self.seconds

    def standard_error(self) -> float:
        mean = self.speed / self.n
        variance = max(self.speed_sq / self.n - mean * mean, 0.0)
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
        speeds.add(tokens / rows * plain_step_seconds, seconds)

    def idle(self, steps: int = 1) -> None:
        """`steps` plain steps went by: the evidence weighs less (IDLE_DECAY), its mean is kept."""
        factor = IDLE_DECAY**steps
        for speeds in self._by_rows.values():
            speeds.fade(factor)

    def ratio(self, rows: int) -> float | None:
        """Speculative steps' tokens/s over plain decoding's at this batch size lately; None: none seen."""
        speeds = self._by_rows.get(self.bucket(rows))
        return speeds.ratio() if speeds is not None and speeds.n > 0 else None

    def loses(self, rows: int) -> bool:
        """Whether speculating at this batch size has lately run slower than plain decoding, by the evidence
        (ARM_Z to give the verdict, LIFT_Z to keep it)."""
        speeds = self._by_rows.get(self.bucket(rows))
        if speeds is None or speeds.n < MIN_STEPS:
            if speeds is not None:
                speeds.losing = False
            return False
        z = LIFT_Z if speeds.losing else ARM_Z
        speeds.losing = speeds.ratio() + z * speeds.standard_error() < 1.0
        return speeds.losing
