"""The running estimates the speculation policy (`adaptive`) learns from: a decayed least-squares line, a
multiplicative correction per batch size, and per-slot acceptance rates by draft position."""

from __future__ import annotations

import math

import numpy as np

from draftsmith.serve.speculation.plan import int_list

# Before any evidence, the chance that draft 1 is accepted, and any later one given those before it were (a
# stretch that drafts well tends to go on drafting well): a guess that makes speculation worth trying; real
# counts outweigh it in a few steps.
INITIAL_RATE, INITIAL_LATER_RATE = 0.7, 0.8
# Per row that drafted, and per step that nothing was drafted, the weight kept by the method's long-run
# acceptance counts (what its running counts fade toward while nothing is drafted): a half-life of about 700
LIFETIME_DECAY = 0.999
# The method's rate at a position is read this many standard errors above its estimate (standard error by
# the position's decayed count of rows reaching it): a position whose evidence has faded is tried again
# sooner, one with plenty is read as measured
OPTIMISM = 0.25


class DecayedLine:
    """y ~ a + b x, fitted by least squares over observations weighted by decay**age. With `prior_weight`, the
    slope is shrunk (by that weight, in units of x variance, fading as evidence grows) toward the line through
    the origin and the mean observation. So one x value seen still extrapolates: in proportion to x, not with
    a guessed slope whose error the intercept would absorb (drafting timed only at 5 forwards, 0.5 of a decode
    each, was priced 1.17 at one forward with the guessed slope 1/3 where it cost 0.5, so narrower plans looked
    dearer than they were)."""

    def __init__(self, decay: float = 0.97, prior_weight: float = 0.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def fade(self, factor: float) -> None:
        self.n, self.sx, self.sxx, self.sy, self.sxy = (factor * v for v in (self.n, self.sx, self.sxx, self.sy, self.sxy))

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sxx = d * self.n + 1, d * self.sx + x, d * self.sxx + x * x
        self.sy, self.sxy = d * self.sy + y, d * self.sxy + x * y

    @property
    def seen(self) -> bool:
        return self.n > 0.5

    def predict(self, x: float) -> float:
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = max(self.sxx / self.n - mean_x * mean_x, 0.0)
        covariance = self.sxy / self.n - mean_x * mean_y
        if self.prior_weight:
            prior = mean_y / mean_x if mean_x else 0.0
            weight = self.prior_weight / self.n
            slope = (covariance + weight * prior) / (var + weight)
        elif var < 1e-9 * max(1.0, mean_x * mean_x):  # one x value seen: no slope to fit
            return max(mean_y, 0.0)
        else:
            slope = covariance / var
        return max(mean_y + slope * (x - mean_x), 0.0)


class ScaleByBatch:
    """A multiplicative correction learned per batch size (rows, in powers of two), as a geometric moving
    average. What speculative steps cost next to their prediction grows with the batch: on the demo model a
    verify of 4 tokens per row took 10.4-11.2 ms at 16 rows where the profile (256 cached tokens per row)
    said 6.7, and 3.4-4.0 ms at 4 rows where it said 3.2. One factor learned at small batches priced 16 rows
    too cheaply, and some 25 losing speculative steps went by before it moved. A batch size without evidence
    borrows its nearest neighbour's factor; its own first observations weigh 1/(n + FIRST_WEIGHT), like a
    running mean, until the moving average's 1 - decay is larger; each moves it as if at most `surprise` x
    off, so that one cold step (oneDNN compiling a kernel for a new shape) cannot price speculation out."""

    FIRST_WEIGHT = 4

    def __init__(self, decay: float, surprise: float):
        self.decay, self.surprise = decay, surprise
        self.log: dict[int, float] = {}
        self.count: dict[int, float] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return max(rows, 1).bit_length()

    def measured(self, rows: int) -> bool:
        """Whether this batch size has evidence of its own (not borrowed from a neighbour's)."""
        return self.count.get(self.bucket(rows), 0.0) > 0

    def get(self, rows: int, default: float = 1.0) -> float:
        return math.exp(self._log_at(self.bucket(rows), math.log(default))) if self.log else default

    def _log_at(self, bucket: int, default: float) -> float:
        """The log factor of this bucket, or of its nearest neighbour with evidence, or `default`."""
        if not self.log:
            return default
        nearest = bucket if bucket in self.log else min(self.log, key=lambda other: (abs(other - bucket), -other))
        return self.log[nearest]

    def fade(self, factor: float, toward: float | ScaleByBatch = 1.0) -> None:
        """Every batch size's factor moves toward `toward`'s (a constant, or another scale's at the same batch
        size; factor 0: all the way), and its evidence count shrinks alike, so that new observations weigh
        as much as they did when it was fresh."""
        for b in self.log:
            target = toward._log_at(b, 0.0) if isinstance(toward, ScaleByBatch) else math.log(toward)
            self.log[b] = target + factor * (self.log[b] - target)
            self.count[b] *= factor

    def observe(self, rows: int, ratio: float, default: float = 1.0) -> None:
        """`ratio`: what a step of `rows` rows took over what the uncorrected model said."""
        b = self.bucket(rows)
        previous = math.log(self.get(rows, default))
        bound = math.log(self.surprise)
        log_ratio = min(max(math.log(max(ratio, 1e-12)), previous - bound), previous + bound)
        n = self.count.get(b, 0.0)
        weight = max(1 - self.decay, 1 / (n + self.FIRST_WEIGHT))
        self.log[b] = previous + weight * (log_ratio - previous)
        self.count[b] = n + 1


class AcceptanceStats:
    """Per slot and draft position: decayed counts of drafts reached and accepted, and the method's running
    totals (the prior each slot's counts are shrunk toward). Plain Python floats, not numpy: the policy runs
    right after the target's forward, whose weights leave the caches cold, and there a numpy op on a few
    values costs 10 us or more where a Python float op costs a fraction of one (in the engine, after each
    verify forward: 8 small numpy ops 89-92 us, as much arithmetic on floats 12.5-12.8 us). A step updates
    k values per row that drafted.

    While nothing is drafted, the method's running totals fade (so that a method is tried again), toward its
    long-run rates (`LIFETIME_DECAY`), not toward the first guesses: fading to those, a head whose first
    draft is accepted 27% of the time (the demo Medusa head) looked like a 70% one again after some 30 plain
    steps, and speculated on 210 of 957 steps at one request in flight (0.86x plain decoding's speed; 44 of
    1002 steps with the long-run anchor, 0.92x).

    A slot's own counts (`decay` per step it drafts) weigh against the method's rates as `prior_weight`
    observations: noisier slot estimates made a lone request's plans flip to plain after two rejections
    where one draft paid 5-8% (tests/unit/test_planner_best_k.py)."""

    def __init__(self, num_slots: int, k: int, decay: float = 0.95, prior_weight: float = 8.0,
                 method_decay: float = 0.99, idle_decay: float = 0.85, method_idle_decay: float = 0.97,
                 initial_weight: float = 4.0):
        self.k, self.decay, self.prior_weight, self.method_decay = k, decay, prior_weight, method_decay
        self.idle_decay, self.method_idle_decay, self.initial_weight = idle_decay, method_idle_decay, initial_weight
        self.initial_rates = [INITIAL_RATE] + [INITIAL_LATER_RATE] * (k - 1)
        # by slot and position: drafts that reached the position (the drafts before it accepted), and of those
        # the ones accepted
        self._reached = [[0.0] * k for _ in range(num_slots)]
        self._accepted = [[0.0] * k for _ in range(num_slots)]
        self.method_reached, self.method_accepted = [0.0] * k, [0.0] * k
        self.lifetime_reached, self.lifetime_accepted = [0.0] * k, [0.0] * k  # never faded by idle steps
        self.rows_drafted = 0

    @property
    def reached(self) -> np.ndarray:
        """[slots, k]: each slot's decayed count of drafts reaching each position (for inspection)."""
        return np.array(self._reached)

    @property
    def accepted(self) -> np.ndarray:
        return np.array(self._accepted)

    def reset(self, slot: int) -> None:
        self._reached[slot] = [0.0] * self.k
        self._accepted[slot] = [0.0] * self.k

    def rates(self, slots, idle_steps: int = 0) -> list[list[float]]:
        """[B][k] conditional acceptance rates of the given slots (any int sequence); with `idle_steps`, what
        they would be after that many steps without drafts (`idle`, in closed form)."""
        if idle_steps:
            slot, method, lifetime = (decay**idle_steps for decay in (self.idle_decay, self.method_idle_decay,
                                                                       LIFETIME_DECAY))
            prior = self._prior([method * v for v in self.method_accepted], [method * v for v in self.method_reached],
                                [lifetime * v for v in self.lifetime_accepted],
                                [lifetime * v for v in self.lifetime_reached])
            return [self._shrunk([slot * v for v in self._accepted[s]], [slot * v for v in self._reached[s]], prior)
                    for s in int_list(slots)]
        prior = self._prior(self.method_accepted, self.method_reached, self.lifetime_accepted, self.lifetime_reached)
        return [self._shrunk(self._accepted[s], self._reached[s], prior) for s in int_list(slots)]

    def _prior(self, method_accepted, method_reached, lifetime_accepted, lifetime_reached) -> list[float]:
        """The method's running rates, read OPTIMISM standard errors high, themselves shrunk toward its long-run
        rates."""
        w0, prior = self.initial_weight, []
        for j, initial in enumerate(self.initial_rates):
            anchor = (lifetime_accepted[j] + w0 * initial) / (lifetime_reached[j] + w0)
            weight = method_reached[j] + w0
            rate = (method_accepted[j] + w0 * anchor) / weight
            prior.append(min(rate + OPTIMISM * math.sqrt(rate * (1 - rate) / weight), 1.0))
        return prior

    def _shrunk(self, accepted, reached, prior) -> list[float]:
        """A slot's counts shrunk toward the method's rates (`_prior`)."""
        w = self.prior_weight
        return [(a + w * p) / (r + w) for a, r, p in zip(accepted, reached, prior)]

    def reached_lately(self, position: int) -> float:
        """The method's decayed count of rows that reached draft `position` (0-based)."""
        return self.method_reached[position]

    def evidence(self) -> int:
        """How many rows have drafted since the engine started (never faded): whether the rates rest on
        anything yet."""
        return self.rows_drafted

    def idle(self, slots, steps: int = 1) -> None:
        """Rows that did not draft for `steps` steps: old evidence fades, so a request (and the method) that
        once drafted badly is tried again after a while instead of never."""
        slot = self.idle_decay**steps
        for s in int_list(slots):
            self._reached[s] = [slot * v for v in self._reached[s]]
            self._accepted[s] = [slot * v for v in self._accepted[s]]
        method = self.method_idle_decay**steps
        self.method_reached = [method * v for v in self.method_reached]
        self.method_accepted = [method * v for v in self.method_accepted]
        # far more slowly, the long-run rates too: a method that drafted badly on one workload is tried again
        # on another one, hundreds of plain steps on
        lifetime = LIFETIME_DECAY**steps
        self.lifetime_reached = [lifetime * v for v in self.lifetime_reached]
        self.lifetime_accepted = [lifetime * v for v in self.lifetime_accepted]

    def observe(self, slots, drafted, accepted) -> None:
        """Rows that drafted `drafted[b]` tokens and had `accepted[b]` of them accepted. Position j was
        reached when the j drafts before it were accepted."""
        k, decay = self.k, self.decay
        reached_sum, hit_sum, rows = [0] * k, [0] * k, 0
        for slot, n_drafted, n_accepted in zip(int_list(slots), int_list(drafted), int_list(accepted)):
            if n_drafted <= 0:
                continue
            rows += 1
            reached = self._reached[slot] = [decay * v for v in self._reached[slot]]
            hits = self._accepted[slot] = [decay * v for v in self._accepted[slot]]
            for j in range(min(n_drafted, n_accepted + 1, k)):  # reached: j < drafted and j <= accepted
                reached[j] += 1
                reached_sum[j] += 1
            for j in range(min(n_accepted, k)):  # accepted: j < accepted
                hits[j] += 1
                hit_sum[j] += 1
        self.rows_drafted += rows
        d = self.method_decay**rows
        self.method_reached = [d * v + n for v, n in zip(self.method_reached, reached_sum)]
        self.method_accepted = [d * v + n for v, n in zip(self.method_accepted, hit_sum)]
        d = LIFETIME_DECAY**rows
        self.lifetime_reached = [d * v + n for v, n in zip(self.lifetime_reached, reached_sum)]
        self.lifetime_accepted = [d * v + n for v, n in zip(self.lifetime_accepted, hit_sum)]
