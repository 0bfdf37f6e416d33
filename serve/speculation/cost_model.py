"""What a decode step costs, by its parts: the cost model the speculation policy (`adaptive`) plans with.

    T(rows, 0) = F(rows, 1) + host_plain(rows),  T(rows, w) = F(rows, 1 + d_w) + draft(rows, w) + host_spec(rows)

where F is the measured target forward table (`cost_profile`), scaled by what live forwards take, d_w the
rows' mean min(w, k_row) (the verify forward is packed: rows that draft less cost less), and draft and host
work are fitted online from the step timings the engine reports: draft(rows, w) = F(rows, 1) (a + b w) for
proposers that run one draft forward per token (a: catch-up and setup, b: one forward), D(rows) a for one-pass
drafters whose step was timed by rows at load (D, `draft_table`), host work linear in rows. Rows that must first feed the draft model a longer run of positions (new requests, or rows resuming
after plain steps) add a catch-up forward of their own, learned per query token and spread over the steps it
serves; where that forward runs a whole draft model, its own profiled table prices it instead, and where it is a
projection of the proposer's own (DFlash's context), that projection's timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftsmith.serve.speculation.cost_profile import ForwardCostTable
from draftsmith.serve.speculation.estimators import DecayedLine, ScaleByBatch
from draftsmith.serve.speculation.realized import RealizedSpeed

DRAFT_STEP_GUESS = 1 / 3  # draft forward / target decode forward, until drafts are timed
OUTLIER = 3.0  # a draft timing above this many times the prediction counts as this many
CATCH_UP_HORIZON = 8  # steps a resumed row's catch-up is spread over
STEP_SURPRISE = 1.5  # one speculative step moves its batch size's corrections as if off by this factor at most
# Per plain step, the weight left to what drafting was measured to cost (draft forwards, catch-ups): plain
# steps re-measure neither, so old evidence fades toward the first guesses (half-life about 23 steps)
COST_IDLE_DECAY = 0.97
# Per plain step, what speculative steps and verify forwards were found to cost beyond their parts (and their
# host work) fades toward no correction, more slowly (half-life about 70 steps). Measurements behind both:
# docs/decisions/adaptive-speculation.md
CORRECTION_IDLE_DECAY = 0.99
PRIOR_WEIGHT = 0.25  # the first guesses weigh as much as this many (decayed) observations
# Speculative steps at a batch size after which its plain price counts as stale (`plain_stale`): before it was
# ever taken, after FIRST_REPRICE (every speculative step is judged against it: `realized`); after
# REPRICE_AFTER since it was last taken (the machine's speed drifts by up to 30% over minutes, and a price
# taken before it slowed judged a winning n-gram batch as losing)
FIRST_REPRICE, REPRICE_AFTER = 16, 256


def _weighed(learned: float, evidence: float, guess: float) -> float:
    """A learned cost against the first guess, by how much (decayed) evidence is behind it (PRIOR_WEIGHT)."""
    weight = evidence / (evidence + PRIOR_WEIGHT)
    return weight * learned + (1 - weight) * guess


@dataclass
class CostModel:
    """Seconds of a decode step's parts, from the profile table and live timings."""

    table: ForwardCostTable
    # each draft token costs one more draft unit (a sequential draft forward, a Medusa head): drafting w tokens
    # costs w units; False: one pass drafts any width at one cost (n-gram lookup, DFlash, parallel drafting)
    per_token_drafts: bool
    drafts_before_plan: bool  # drafting already happened when the plan is made: its cost is sunk
    # A draft forward is priced against the target's forward of `draft_query_len` tokens a row (1: a head
    # drafting a token a row per forward; a block drafter's block), at first `draft_guess` times it: a block
    # grows with the rows as the target's forward of a block does, not as a decode does.
    draft_query_len: int = 1
    draft_guess: float | None = None  # None: DRAFT_STEP_GUESS
    # live / table seconds: the table gives the shape of the cost, live steps its level today (context length,
    # other load); a geometric moving average, so one slow step moves it little. Decode and verify forwards
    # keep a factor each: longer contexts than the table's make a wide verify dearer relative to a decode,
    # and one shared factor would price plain steps by what verify steps cost.
    # decode forwards by batch size: the profile's context (256 cached tokens) is shorter than live ones, and
    # attention, whose cost grows with the context, is a larger share of a step the more rows there are, so
    # one factor for every size would price some of them wrong.
    forward_scales: ScaleByBatch = field(default_factory=lambda: ScaleByBatch(0.95, STEP_SURPRISE))
    # verify forwards (query_len > 1) by batch size; until one is timed: the decode scale
    verify_scales: ScaleByBatch = field(default_factory=lambda: ScaleByBatch(0.95, STEP_SURPRISE))
    live_scaling: bool = True  # False: the table alone prices forwards (tests with synthetic tables)
    # drafting seconds / F(rows, draft_query_len) (or / the timed draft step, `draft_table`), by draft forwards run:
    # a fixed part (catch-up, setup) plus a part per forward; relative to the target's forward of `draft_query_len`
    # tokens a row (a decode for most heads)
    # so that its growth with rows comes from the measured table, while steps within one call (1..k)
    # identify the two parts. Before evidence: `draft_guess` per forward (a one-layer head: about a third).
    draft_ratio: DecayedLine = field(init=False)
    # seconds of a catch-up's own draft forward by its query tokens (rows x (1 + their longest pending run)),
    # from the proposes that had one: a fixed part (replaying the kept steps' features, a launch) plus a part
    # per token, so that a short catch-up's fixed costs are not priced into every token of a long one (read as
    # a price per token, short ones priced a full ring of 60 positions at 3x what it took). Before any, guessed
    # from the target's table and the draft forward ratio.
    catch_up_line: DecayedLine = field(default_factory=lambda: DecayedLine(decay=0.8, prior_weight=0.5))
    catch_up_weight: float = 0.0  # the catch-ups behind it, decayed per catch-up and faded by plain steps
    # where catch-ups run a whole draft model, its own forward table; where they run a projection of their own
    # (a block drafter's context), that projection timed over a grid (`Proposer.catch_up_timer`). Either prices
    # them alone, without learning: a per-token price learned from short catch-ups, whose fixed costs dominate,
    # priced a draft model's prompt 3-4x over, and a DFlash head's kept prompt 8-14x
    catch_up_table: ForwardCostTable | None = None
    # where one forward drafts any width, its steady step timed by rows (`Proposer.draft_timer`): the unit that
    # `draft_ratio` is learned in and its first guess (1), in place of the target's forward of a block, which
    # grows with the rows otherwise (the demo DSpark head was priced 40% under its cost at 8 rows, so the plan
    # speculated again each time the learned ratio faded back toward the guess)
    draft_table: ForwardCostTable | None = None
    # a steady speculative step's measured seconds / the sum of its parts as predicted: each part is fitted
    # on its own but over all batch sizes and widths at once, so the whole may cost more than its parts say
    # (geometric moving average; a surprising step moves it only STEP_SURPRISE x its weight, so that one
    # cold step cannot price speculation out on its own); by batch size, as what it corrects grows with it
    spec_corrections: ScaleByBatch = field(default_factory=lambda: ScaleByBatch(0.95, STEP_SURPRISE))
    host_plain: DecayedLine = field(default_factory=DecayedLine)  # step seconds outside forward + drafting
    host_spec: DecayedLine = field(default_factory=DecayedLine)
    # what steady speculative steps really yielded next to plain decoding's price: the check on the plans
    realized: RealizedSpeed = field(default_factory=RealizedSpeed)
    # by batch size (as `forward_scales`): speculative steps since plain decoding was last timed there
    plain_age: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.draft_table is not None:
            self.draft_guess = 1.0
        elif self.draft_guess is None:
            self.draft_guess = DRAFT_STEP_GUESS
        self.draft_ratio = DecayedLine(prior_weight=0.5)

    def forward(self, rows: int, query_len: float) -> float:
        scale = self.forward_scales.get(rows)
        if query_len != 1:
            scale = self.verify_scales.get(rows, scale)
        return self.table.estimate(rows, query_len) * scale

    def draft(self, rows: int, width: int) -> float:
        """Drafting seconds for `rows` steady rows drafting `width` tokens (a catch-up: `catch_up`), as a plan
        prices them: nothing where drafting came before the plan."""
        return 0.0 if self.drafts_before_plan else self.drafting(rows, width)

    def drafting(self, rows: int, width: int) -> float:
        """What drafting `width` tokens for `rows` steady rows costs, sunk or not."""
        if width == 0:
            return 0.0
        forwards = width if self.per_token_drafts else 1
        return self._draft_ratio(forwards) * self._draft_unit(rows)

    def _draft_unit(self, rows: int) -> float:
        """Seconds that a draft ratio of 1 stands for at this batch size: the timed draft step where there is
        one, else the target's forward of `draft_query_len` tokens a row."""
        if self.draft_table is not None:
            return self.draft_table.estimate(rows, 1)
        return self.forward(rows, self.draft_query_len)

    def _draft_ratio(self, forwards: int) -> float:
        """Drafting seconds / F(rows, draft_query_len) for this many draft forwards: the fit weighed against the
        guess."""
        guess = self.draft_guess * forwards
        if not self.draft_ratio.seen:
            return guess
        return _weighed(self.draft_ratio.predict(forwards), self.draft_ratio.n, guess)

    def idle(self, steps: int = 1) -> None:
        """`steps` plain steps went by: what drafting was measured to cost fades toward the first guesses (see
        COST_IDLE_DECAY), and the speculative corrections toward none (CORRECTION_IDLE_DECAY)."""
        factor = COST_IDLE_DECAY**steps
        self.draft_ratio.fade(factor)
        self.catch_up_weight *= factor
        fading = CORRECTION_IDLE_DECAY**steps
        self.spec_corrections.fade(fading)
        self.verify_scales.fade(fading, self.forward_scales)  # toward the decode scale of the same batch size
        self.host_spec.fade(fading)  # once faded out (n < 0.5), speculative steps are priced at plain's host work
        self.realized.idle(steps)

    def catch_up(self, rows: int, positions: int) -> float:
        """Seconds of a catch-up's own draft forward: `rows` rows of up to 1 + `positions` queries."""
        if rows <= 0 or positions <= 0:
            return 0.0
        guess = self._catch_up_guess(rows, positions)
        line = self.catch_up_line
        if self.catch_up_table is not None or not line.n:
            return guess
        # Catch-ups are re-measured only when one runs. Priced below what it takes, the next one runs and
        # corrects it, so a learned price under the guess stands however long nothing is drafted. Priced above,
        # none may ever run again: so a price over the guess fades back toward it, weighed by the evidence,
        # and stays within OUTLIER x of it (a stalled first one: oneDNN compiles a kernel for each new shape).
        # Faded toward a guess above it, a full ring's catch-up doubled its price over a hold and held the
        # demo P-EAGLE head plain for 64 steps at a time.
        learned = line.predict(rows * (1 + positions))
        if learned <= guess:
            return learned
        return _weighed(min(learned, OUTLIER * guess), self.catch_up_weight, guess)

    def _catch_up_guess(self, rows: int, positions: int) -> float:
        if self.catch_up_table is not None:  # the positions ride the first draft forward: what they add to it
            first = self.draft_query_len
            table = self.catch_up_table
            return max(table.estimate(rows, first + positions) - table.estimate(rows, first), 0.0)
        # the target's forward of that shape, times what one draft forward costs next to a target decode (or,
        # where a draft forward was timed, `draft_table`: the ratios are in its unit, which grows with the
        # positions as the target's decode does)
        per_forward = max(self._draft_ratio(2) - self._draft_ratio(1), self.draft_guess / 4)
        forward = self.forward(rows, 1 + positions)
        if self.draft_table is not None:
            forward *= self._draft_unit(rows) / max(self.forward(rows, 1), 1e-12)
        return per_forward * forward

    def observe_catch_up(self, catch_up: tuple[int, int], rows: int, forwards: int, seconds: float) -> None:
        """A propose that ran a catch-up forward for `catch_up` (rows, positions): what it took beyond a
        steady propose of as many draft forwards."""
        tokens = catch_up[0] * (1 + catch_up[1])
        if tokens <= 0 or self.catch_up_table is not None:
            return
        extra = max(seconds - self.drafting(rows, forwards if self.per_token_drafts else 1), 0.0)
        self.catch_up_line.add(tokens, min(extra, OUTLIER * max(self._catch_up_guess(*catch_up), 1e-9)))
        self.catch_up_weight = self.catch_up_line.decay * self.catch_up_weight + 1

    def observe_draft(self, rows: int, forwards: int, seconds: float) -> None:
        ratio = seconds / max(self._draft_unit(rows), 1e-9)
        # One stalled step (the OS, a first-touch allocation) must not price drafting out for good: it is only
        # re-measured while the policy drafts. A cost really that high still gets there, OUTLIER x at a time.
        expected = max(self.draft_guess * forwards, self._draft_ratio(forwards))
        self.draft_ratio.add(forwards, min(ratio, OUTLIER * expected))

    def observe_host(self, rows: int, speculative: bool, seconds: float) -> None:
        """A step's seconds outside the target forward and drafting. Clipped like a draft timing: one stall
        (the OS, a first-touch allocation) in a speculative step must not price speculation out for good, as
        plain steps never re-measure it."""
        line = self.host_spec if speculative else self.host_plain
        if line.seen:
            seconds = min(seconds, OUTLIER * max(line.predict(rows), 1e-4))
        line.add(rows, seconds)

    def host(self, rows: int, speculative: bool) -> float:
        line, other = (self.host_spec, self.host_plain) if speculative else (self.host_plain, self.host_spec)
        if line.seen:
            return line.predict(rows)
        return other.predict(rows) if other.seen else 0.0

    def step_seconds(self, rows: int, width: int, catch_up: tuple[int, int] = (0, 0),
                     query_len: float | None = None) -> float:
        """A step of `width` drafts per row; `catch_up`: how many rows must first feed the draft model more
        positions than a verify step brings (new rows, rows resuming after plain steps), and the most extra
        positions one has (`Proposer.catch_up`); `query_len`: the rows' mean verified tokens, when rows
        draft fewer than `width` (a packed verify forward costs its real tokens), else width + 1."""
        if width == 0:
            return self.forward(rows, 1) + self.host(rows, False)
        # a catch-up is paid once, and the context it restores serves the drafts of the steps after it too:
        # spread over CATCH_UP_HORIZON of them (priced whole on one step, a new row would never start)
        return self._spec_parts(rows, width, query_len) * self.spec_corrections.get(rows) + \
            self.catch_up(*catch_up) / CATCH_UP_HORIZON

    def step_seconds_by_width(self, rows: int, query_lens: list[float], catch_up: tuple[int, int] = (0, 0),
                              horizon: int = CATCH_UP_HORIZON) -> list[float]:
        """`step_seconds(rows, w, catch_up, query_lens[w])` for every w in 0..len - 1 (query_lens[0] unused),
        with what the widths share looked up once: a plan prices every width every step, and at one row in
        flight its 60-odd small calls were a third of a speculative step's host work. `horizon`: the steps the
        catch-up is spread over."""
        decode = self.forward(rows, 1)
        seconds = [decode + self.host(rows, False)]
        if len(query_lens) == 1:
            return seconds
        scale = self.forward_scales.get(rows)
        verify_scale, host = self.verify_scales.get(rows, scale), self.host(rows, True)
        correction, catch = self.spec_corrections.get(rows), self.catch_up(*catch_up) / horizon
        draft_forward = decode if self.draft_query_len == 1 and self.draft_table is None else self._draft_unit(rows)
        widths = range(1, len(query_lens))
        if self.drafts_before_plan:
            drafting = [0.0 for _ in widths]
        elif self.per_token_drafts:
            drafting = [self._draft_ratio(width) * draft_forward for width in widths]
        else:  # one pass drafts any width at one cost
            drafting = [self._draft_ratio(1) * draft_forward] * len(widths)
        for width, draft in zip(widths, drafting):
            query_len = query_lens[width]
            verify = self.table.estimate(rows, query_len) * (scale if query_len == 1 else verify_scale)
            seconds.append((verify + draft + host) * correction + catch)
        return seconds

    def _spec_parts(self, rows: int, width: int, query_len: float | None) -> float:
        verify = self.forward(rows, query_len if query_len is not None else width + 1)
        return verify + self.draft(rows, width) + self.host(rows, True)

    def observe_step(self, rows: int, width: int, seconds: float, query_len: float | None = None) -> None:
        """A steady speculative step of `width` drafts (`query_len`: mean verified tokens per row) took
        `seconds` in all."""
        if not self.live_scaling or width == 0:
            return
        ratio = seconds / max(self._spec_parts(rows, width, query_len), 1e-9)
        self.spec_corrections.observe(rows, ratio)

    def plain_stale(self, rows: int) -> bool:
        """Whether plain decoding at this batch size should be timed again before more speculation is judged
        against it (FIRST_REPRICE, REPRICE_AFTER)."""
        if not self.live_scaling:
            return False
        age = self.plain_age.get(ScaleByBatch.bucket(rows), 0)
        return age >= (REPRICE_AFTER if self.forward_scales.measured(rows) else FIRST_REPRICE)

    def observe_yield(self, rows: int, tokens: int, seconds: float) -> None:
        """A steady speculative step gave `tokens` tokens in `seconds` in all (drafting included, sunk or not:
        a held step skips it): judged against the price of a plain step of as many rows (`realized`), once
        plain steps of that batch size have set it (the profile alone was taken at another context and load)."""
        bucket = ScaleByBatch.bucket(rows)
        self.plain_age[bucket] = self.plain_age.get(bucket, 0) + 1
        if self.live_scaling and not (self.forward_scales.measured(rows) and self.host_plain.seen):
            return
        self.realized.observe(rows, tokens, seconds, self.step_seconds(rows, 0))

    def observe_forward(self, rows: int, query_len: float, seconds: float) -> None:
        if not self.live_scaling:
            return
        log_ratio = math.log(max(seconds, 1e-9) / max(self.table.estimate(rows, query_len), 1e-9))
        if query_len == 1:
            self.forward_scales.observe(rows, math.exp(log_ratio))
            self.plain_age[ScaleByBatch.bucket(rows)] = 0
        else:
            self.verify_scales.observe(rows, math.exp(log_ratio), self.forward_scales.get(rows))
