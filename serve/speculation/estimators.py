"""The running estimates the speculation policy (`adaptive`) learns from: a decayed least-squares line, a
multiplicative correction per batch size, and per-slot acceptance rates by draft position."""

from __future__ import annotations

import math

import numpy as np

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
    totals (the prior each slot's counts are shrunk toward). Host-side numpy: a step updates a few [rows, k]
    arrays, and numpy's per-op cost is a fraction of torch's (alone, at 1-16 rows: 18 us an update against
    43, a plan 35 us against 57).

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
        self.initial_rates = np.full(k, INITIAL_LATER_RATE)
        self.initial_rates[:1] = INITIAL_RATE
        # One array holds every count, so that a step updates it in a few numpy ops (each costs microseconds
        # whatever its size, more with the caches cold after a forward): [slot, (reached, accepted), position]
        # for each slot, then the method's running counts and its long-run ones (never faded by idle steps).
        self.counts = np.zeros((num_slots + 2, 2, k))
        self.num_slots = num_slots
        self._method_decays: dict[int, np.ndarray] = {}  # rows drafted in a step -> [running, long-run] decay
        # what a row that drafted d and had a accepted adds: [d, a] -> [(reached, accepted), position], position
        # j reached when the j drafts before it were accepted
        positions = np.arange(k)
        drafted, accepted = np.arange(k + 1)[:, None, None], np.arange(k + 1)[None, :, None]
        self._step_counts = np.stack(np.broadcast_arrays(
            (positions < drafted) & (positions <= accepted), positions < accepted), axis=2).astype(float)
        self.rows_drafted = 0

    # views into `counts` (properties, so that a copy of the object keeps them views of its own counts)
    reached = property(lambda self: self.counts[: self.num_slots, 0])
    accepted = property(lambda self: self.counts[: self.num_slots, 1])
    _method_counts = property(lambda self: self.counts[self.num_slots :])  # the method's two rows
    method_reached = property(lambda self: self.counts[self.num_slots, 0])
    method_accepted = property(lambda self: self.counts[self.num_slots, 1])
    lifetime_reached = property(lambda self: self.counts[self.num_slots + 1, 0])
    lifetime_accepted = property(lambda self: self.counts[self.num_slots + 1, 1])

    def reset(self, slot: int) -> None:
        self.counts[slot] = 0

    def rates(self, slots, idle_steps: np.ndarray | None = None) -> np.ndarray:
        """[B, k] conditional acceptance rates of the given slots (any int sequence); with `idle_steps` (ints
        [N]), [N, B, k]: what the rates would be after that many steps without drafts (`idle`, in closed form)."""
        slot_counts = self.counts[np.asarray(slots)]  # [B, 2, k]
        if idle_steps is None:
            return self._shrunk(slot_counts[:, 1], slot_counts[:, 0], self.method_accepted, self.method_reached,
                                self.lifetime_accepted, self.lifetime_reached)
        lifetime, method, slot = (decay ** np.asarray(idle_steps, dtype=float)[:, None]
                                  for decay in (LIFETIME_DECAY, self.method_idle_decay, self.idle_decay))
        slot = slot[..., None]  # [N, 1, 1] fading a slot's [B, k] counts
        return self._shrunk(slot_counts[:, 1] * slot, slot_counts[:, 0] * slot, self.method_accepted * method,
                            self.method_reached * method, self.lifetime_accepted * lifetime,
                            self.lifetime_reached * lifetime)

    def _shrunk(self, accepted, reached, method_accepted, method_reached, lifetime_accepted, lifetime_reached):
        """A slot's counts ([..., B, k]) shrunk toward the method's running rates ([..., k]), read OPTIMISM
        standard errors high, themselves shrunk toward its long-run rates."""
        w0 = self.initial_weight
        anchor = (lifetime_accepted + w0 * self.initial_rates) / (lifetime_reached + w0)
        method_weight = method_reached + w0
        prior = (method_accepted + w0 * anchor) / method_weight
        prior = np.minimum(prior + OPTIMISM * np.sqrt(prior * (1 - prior) / method_weight), 1.0)
        w = self.prior_weight
        return (accepted + w * prior[..., None, :]) / (reached + w)

    def reached_lately(self, position: int) -> float:
        """The method's decayed count of rows that reached draft `position` (0-based)."""
        return float(self.method_reached[position])

    def evidence(self) -> int:
        """How many rows have drafted since the engine started (never faded): whether the rates rest on
        anything yet."""
        return self.rows_drafted

    def idle(self, slots, steps: int = 1) -> None:
        """Rows that did not draft for `steps` steps: old evidence fades, so a request (and the method) that
        once drafted badly is tried again after a while instead of never."""
        self.counts[np.asarray(slots)] *= self.idle_decay**steps
        # the method's running counts, and far more slowly its long-run ones: a method that drafted badly on one
        # workload is tried again on another one, hundreds of plain steps on
        method = self._method_counts
        method *= np.array([self.method_idle_decay**steps, LIFETIME_DECAY**steps])[:, None, None]

    def observe(self, slots, drafted, accepted) -> None:
        """Rows that drafted `drafted[b]` tokens (at most k) and had `accepted[b]` of them accepted."""
        slots, drafted, accepted = np.asarray(slots), np.asarray(drafted), np.asarray(accepted)
        if not drafted.all():
            spoke = drafted > 0
            slots, drafted, accepted = slots[spoke], drafted[spoke], accepted[spoke]
        rows = len(slots)
        if not rows:
            return
        step = self._step_counts[drafted, accepted]  # [rows, 2, k]
        self.counts[slots] = self.decay * self.counts[slots] + step
        self.rows_drafted += rows
        decays = self._method_decays.get(rows)
        if decays is None:
            decays = self._method_decays[rows] = np.array([self.method_decay**rows, LIFETIME_DECAY**rows])[:, None, None]
        method = self._method_counts
        method *= decays
        method += step.sum(0)
