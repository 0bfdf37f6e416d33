"""Adaptive speculation: each decode step, how many tokens to draft, chosen to maximise expected tokens/s.

Speculating pays only when the tokens it gains outweigh what it costs, and both sides move: acceptance
differs by request and by stretch of text, and the cost of verifying k+1 tokens per row grows with the batch
(on a small CPU target, 5 tokens x 1 row cost 1.1x one decode token but 5 x 32 rows cost 2.4x). So the
planner models both and picks, per step, the draft width w in 0..k (the config's num_speculative_tokens
is the cap) that maximises

    expected tokens / expected seconds = sum_rows (1 + sum_{j <= k_row} prod_{m <= j} a_row,m) / T(rows, w)

with k_row = min(w, the row's limit), a_row,m the row's acceptance rate at draft position m given the
earlier ones were accepted (exponentially decayed counts, shrunk toward the method's running rates,
which start optimistic so that speculation is tried), and

    T(rows, 0) = F(rows, 1) + host_plain(rows),  T(rows, w) = F(rows, 1 + d_w) + draft(rows, w) + host_spec(rows)

where F is the measured target forward table (`cost_profile`), scaled by what live forwards take, d_w the
rows' mean min(w, k_row) (the verify forward is packed: rows that draft less cost less), and
draft and host work are fitted online from the step timings the engine reports: draft(rows, w) =
F(rows, 1) (a + b w) for proposers that run one draft forward per token (a: catch-up and setup, b: one
forward), host work linear in rows. w = 0 is plain decoding. Rows that must first feed the draft model a
longer run of positions (new requests, or rows resuming after plain steps) add a catch-up forward of their
own, learned per query token and spread over the steps it serves. Plain steps teach nothing about drafting,
so long plain stretches are probed now and then (PROBE_AFTER).

For proposers that know their confidence, the planner also sets the confidence floor under which drafting
stops: one more sequential draft step costs about `c` seconds for the whole batch and gains each row's
chance `P` of getting that far, which pays while the rows' mean P exceeds c times a row's expected tokens
per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from draftsmith.serve.speculation.cost_profile import ForwardCostTable
from draftsmith.serve.speculation.estimators import AcceptanceStats, DecayedLine, ScaleByBatch

FLOOR_MARGIN = 0.5
DRAFT_STEP_GUESS = 1 / 3  # draft forward / target decode forward, until drafts are timed
OUTLIER = 3.0  # a draft timing above this many times the prediction counts as this many
CATCH_UP_HORIZON = 8  # steps a resumed row's catch-up is spread over
PLAIN_HOLD = 8  # after a plan without speculation, the batch is re-planned this many steps later
# ... unless speculating came within CLOSE_CALL of plain decoding's tokens/s: then CLOSE_HOLD steps. One bad
# step (the first drafts after a prompt that ends mid-word accept 0.5 of 5 on the demo EAGLE-3 head, the
# next ones 1.5-2.5) makes a lone request's plan a close call, and holding it plain for 8 steps each time cost
# 110-190 plain steps of 1024 tokens at one request in flight (1.26-1.28x; held 2 steps: 1.29-1.31x). Big
# batches keep the long hold and its saved planning: one request's bad step moves their plan little, and a
# close call there is noise (re-planned every 2 steps, 16 rows paid 2% of their steps in planning).
CLOSE_CALL, CLOSE_HOLD, CLOSE_CALL_ROWS = 0.9, 2, 4
# ... and where speculating lost clearly (below CLOSE_CALL of plain decoding's tokens/s), each plan that says
# so again doubles the hold, up to MAX_PLAIN_HOLD steps (but not past a due probe): a plan costs 0.3-0.4 ms
# at 16-32 rows, which re-planned every PLAIN_HOLD steps was 0.5% of a plain step there, for the same answer
# each time.
MAX_PLAIN_HOLD = 64
# A hold goes on while the batch keeps all but 1/HOLD_SHRINK of its rows: at 32 in flight a request
# finishes every few steps, and the step that prefills the next one decodes 31 rows, which had re-planned
# (speculation's price at 31 rows is no news when it lost at 32).
HOLD_SHRINK = 8
# Plain steps teach the planner nothing about drafting: an estimate made pessimistic by a few cold first
# steps (allocations, a warm-up's odd prompt) would keep speculation off for good. So after PROBE_AFTER
# plain steps in a row, a plan that still says no speculates anyway for PROBE_STEPS steps (the first
# resumes, the second is timed as a steady one) if it is predicted at least PROBE_WORST of plain decoding's
# tokens/s; each probe that changes nothing doubles the wait, up to MAX_PROBE_AFTER steps.
PROBE_AFTER, MAX_PROBE_AFTER, PROBE_STEPS, PROBE_WORST = 16, 256, 2, 0.7
# Until this many rows have drafted since the engine started, a due probe is judged at acceptance no worse
# than the first guesses, and neither holds nor probes wait longer. An engine's first two drafts (the demo
# EAGLE-3 head's first request, its prompt cut mid-word) were both rejected; their 0 of 2 set every later
# request's first-draft rate near 0.5, where speculating (with a catch-up priced whole) looked under 0.7x
# plain decoding's speed, so no probe ran and no evidence came to undo it: the first 8 requests at one in
# flight decoded 549 of about 700 steps plainly (1.17x; 1.39x in later rounds, once drafts had been seen).
THIN_EVIDENCE = 16
STEP_SURPRISE = 1.5  # one speculative step moves its batch size's corrections as if off by this factor at most
# Per plain step, the weight left to what drafting was measured to cost (draft forwards, catch-ups): plain
# steps re-measure neither, and timings skewed by a cold start (oneDNN compiles a kernel per new shape) kept
# EAGLE-3 off for good at one request in flight. Faded evidence gives way to the first guesses, which make
# probing worth it again (half-life about 23 steps).
COST_IDLE_DECAY = 0.97
# Per plain step, what speculative steps and verify forwards were found to cost beyond their parts (and their
# host work) fades toward no correction, more slowly (half-life about 70 steps): one slow stretch of the VM
# while speculating at one request in flight had priced speculation out there, and (borrowed by larger
# batches, which had no evidence of their own) at 4-32 in flight too, for the rest of the run. Where
# speculation really loses, a faded correction costs a few speculative steps every hundred or so, relearned
# at the running-mean rate.
CORRECTION_IDLE_DECAY = 0.99
# Per plan, the weight kept by the running share of rows that found drafts (n-gram on code: 43-53% of row steps)
DRAFT_SHARE_DECAY = 0.9
PRIOR_WEIGHT = 0.25  # the first guesses weigh as much as this many (decayed) observations


def _weighed(learned: float, evidence: float, guess: float) -> float:
    """A learned cost against the first guess, by how much (decayed) evidence is behind it (PRIOR_WEIGHT)."""
    weight = evidence / (evidence + PRIOR_WEIGHT)
    return weight * learned + (1 - weight) * guess


@dataclass
class StepPlan:
    width: int  # drafts per row at most this step (0 = plain decode)
    stop_below: float = 0.0  # confidence floor for proposers that stop early
    expected_tokens: float = 0.0
    expected_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.expected_seconds if self.expected_seconds else 0.0


@dataclass
class CostModel:
    """Seconds of a decode step's parts, from the profile table and live timings."""

    table: ForwardCostTable
    sequential_drafts: bool  # each draft token is one more draft forward
    drafts_before_plan: bool  # drafting already happened when the plan is made: its cost is sunk
    # A draft forward is priced against the target's forward of `draft_query_len` tokens a row (1: a head
    # drafting a token a row per forward; a block drafter's block), at first `draft_guess` times it. Priced
    # against a one-token decode, the 3-layer demo DFlash head (a block of 9 a row) took 6.6 ms a propose at
    # 8 in flight where the first guess said 1.75 and the ratio learned at one row (0.77 of a decode) 4.1: a
    # block grows with the rows as the target's 9-token forward does, twice as fast as a decode. Priced
    # against that forward: 5.7 at first, 7.6 once learned.
    draft_query_len: int = 1
    draft_guess: float | None = None  # None: DRAFT_STEP_GUESS
    # live / table seconds: the table gives the shape of the cost, live steps its level today (context length,
    # other load); a geometric moving average, so one slow step moves it little. Decode and verify forwards
    # keep a factor each: longer contexts than the table's make a wide verify dearer relative to a decode,
    # and one shared factor would price plain steps by what verify steps cost.
    # decode forwards by batch size: the profile's context (256 cached tokens) is shorter than live ones, and
    # attention, whose cost grows with the context, is a larger share of a step the more rows there are
    # (demo decodes in a bench ran at 0.9x the profile at one row, 2.1-2.3 ms against 2.40, and 1.5x at 16,
    # 6.15 against 4.17). One factor for every size priced some of them wrong by up to that 1.6x.
    forward_scales: ScaleByBatch = field(default_factory=lambda: ScaleByBatch(0.95, STEP_SURPRISE))
    # verify forwards (query_len > 1) by batch size; until one is timed: the decode scale
    verify_scales: ScaleByBatch = field(default_factory=lambda: ScaleByBatch(0.95, STEP_SURPRISE))
    live_scaling: bool = True  # False: the table alone prices forwards (tests with synthetic tables)
    # drafting seconds / F(rows, draft_query_len), by draft forwards run: a fixed part (catch-up, setup) plus a part per
    # forward; relative to the target's forward of `draft_query_len` tokens a row (a decode for most heads)
    # so that its growth with rows comes from the measured table, while steps within one call (1..k)
    # identify the two parts. Before evidence: `draft_guess` per forward (a one-layer head: about a third).
    draft_ratio: DecayedLine = field(init=False)
    # seconds per query token of a catch-up's own draft forward (rows x their longest pending run), from the
    # proposes that had one; before any, guessed from the target's table and the draft forward ratio
    catch_up_per_token: float | None = None
    catch_up_weight: float = 0.0  # decayed count of catch-ups behind catch_up_per_token
    # a steady speculative step's measured seconds / the sum of its parts as predicted: each part is fitted
    # on its own but over all batch sizes and widths at once, and at 16-32 rows on this CPU the whole came
    # out 10-20% dearer than its parts said (geometric moving average; a cold first step, 3x too slow,
    # moves it only STEP_SURPRISE x its weight, so that it cannot price speculation out on its own); by batch
    # size, as what it corrects grows with the batch
    spec_corrections: ScaleByBatch = field(default_factory=lambda: ScaleByBatch(0.95, STEP_SURPRISE))
    host_plain: DecayedLine = field(default_factory=DecayedLine)  # step seconds outside forward + drafting
    host_spec: DecayedLine = field(default_factory=DecayedLine)

    def __post_init__(self) -> None:
        if self.draft_guess is None:
            self.draft_guess = DRAFT_STEP_GUESS
        self.draft_ratio = DecayedLine(prior_slope=self.draft_guess, prior_weight=0.5)

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
        forwards = width if self.sequential_drafts else 1
        return self._draft_ratio(forwards) * self.forward(rows, self.draft_query_len)

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

    def catch_up(self, rows: int, positions: int) -> float:
        """Seconds of a catch-up's own draft forward: `rows` rows of up to 1 + `positions` queries."""
        if rows <= 0 or positions <= 0:
            return 0.0
        guess = self._catch_up_guess(rows, positions)
        if self.catch_up_per_token is None:
            return guess
        # Within OUTLIER x the guess, and weighed against it: catch-ups are re-measured only when one runs,
        # and one priced far too high (a stalled first one: oneDNN compiles a kernel for each new shape)
        # kept a request from ever resuming drafting.
        learned = min(self.catch_up_per_token * rows * (1 + positions), OUTLIER * guess)
        return _weighed(learned, self.catch_up_weight, guess)

    def _catch_up_guess(self, rows: int, positions: int) -> float:
        # the target's forward of that shape, times what one draft forward costs next to a target decode
        per_forward = max(self._draft_ratio(2) - self._draft_ratio(1), self.draft_guess / 4)
        return per_forward * self.forward(rows, 1 + positions)

    def observe_catch_up(self, catch_up: tuple[int, int], rows: int, forwards: int, seconds: float,
                         decay: float = 0.8) -> None:
        """A propose that ran a catch-up forward for `catch_up` (rows, positions): what it took beyond a
        steady propose of as many draft forwards."""
        tokens = catch_up[0] * (1 + catch_up[1])
        if tokens <= 0:
            return
        extra = max(seconds - self.drafting(rows, forwards if self.sequential_drafts else 1), 0.0)
        per_token = min(extra, OUTLIER * max(self._catch_up_guess(*catch_up), 1e-9)) / tokens
        previous = self.catch_up_per_token
        self.catch_up_per_token = per_token if previous is None else decay * previous + (1 - decay) * per_token
        self.catch_up_weight = decay * self.catch_up_weight + 1

    def observe_draft(self, rows: int, forwards: int, seconds: float) -> None:
        ratio = seconds / max(self.forward(rows, self.draft_query_len), 1e-9)
        # One stalled step (the OS, a first-touch allocation) must not price drafting out for good: it is only
        # re-measured while the planner drafts. A cost really that high still gets there, OUTLIER x at a time.
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

    def step_seconds_by_width(self, rows: int, query_lens: list[float],
                              catch_up: tuple[int, int] = (0, 0)) -> list[float]:
        """`step_seconds(rows, w, catch_up, query_lens[w])` for every w in 0..len - 1 (query_lens[0] unused),
        with what the widths share looked up once: a plan prices every width every step, and at one row in
        flight its 60-odd small calls were a third of a speculative step's host work."""
        decode = self.forward(rows, 1)
        seconds = [decode + self.host(rows, False)]
        if len(query_lens) == 1:
            return seconds
        scale = self.forward_scales.get(rows)
        verify_scale, host = self.verify_scales.get(rows, scale), self.host(rows, True)
        correction, catch = self.spec_corrections.get(rows), self.catch_up(*catch_up) / CATCH_UP_HORIZON
        draft_forward = decode if self.draft_query_len == 1 else self.forward(rows, self.draft_query_len)
        for width in range(1, len(query_lens)):
            query_len = query_lens[width]
            verify = self.table.estimate(rows, query_len) * (scale if query_len == 1 else verify_scale)
            draft = 0.0 if self.drafts_before_plan else \
                self._draft_ratio(width if self.sequential_drafts else 1) * draft_forward
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

    def observe_forward(self, rows: int, query_len: float, seconds: float) -> None:
        if not self.live_scaling:
            return
        log_ratio = math.log(max(seconds, 1e-9) / max(self.table.estimate(rows, query_len), 1e-9))
        if query_len == 1:
            self.forward_scales.observe(rows, math.exp(log_ratio))
        else:
            self.verify_scales.observe(rows, math.exp(log_ratio), self.forward_scales.get(rows))


class SpeculationPlanner:
    """Chooses each step's draft width; `adaptive=False` keeps the config's k, or vLLM's
    num_speculative_tokens_per_batch_size table when one is given."""

    def __init__(self, k: int, num_slots: int, cost: CostModel | None, adaptive: bool = True,
                 per_batch_size: list[tuple[int, int, int]] | None = None):
        self.k, self.cost, self.per_batch_size = k, cost, per_batch_size
        self.adaptive = adaptive and per_batch_size is None and cost is not None
        self.confidence_floor = True  # let confident proposers stop early (tests turn it off to force drafts)
        self.acceptance = AcceptanceStats(num_slots, k)
        self.row_widths = [0] * (k + 1)  # (row, step) pairs by the draft limit they were given
        self.plain_steps = 0
        # a plan without speculation holds while the batch keeps at least as many rows: plain steps left, that
        # row count, the slots last held and held steps whose idle decay is not yet applied to them
        self._hold, self._held_rows, self._held_slots, self._idle_steps = 0, 0, (), 0
        self._clear_losses = 0  # plain plans in a row where speculating lost clearly (MAX_PLAIN_HOLD)
        self._plain_run, self._probe_after, self._probing = 0, PROBE_AFTER, 0  # see PROBE_AFTER
        self._draft_share = 1.0  # proposers that draft before the plan: the share of rows with drafts, lately

    def may_draft(self, rows: int) -> bool:
        """Whether a plan for this many rows can speculate at all (a fixed table may say 0 for them)."""
        return self.adaptive or self.fixed_width(rows) > 0

    def fixed_width(self, rows: int) -> int:
        for lo, hi, width in self.per_batch_size or ():
            if lo <= rows <= hi:
                return width
        return self.k

    def admit(self, slot: int) -> None:
        """A new request in `slot`: no evidence yet (a hold goes on: the method's rates, which the new row
        starts from, were in the plan that made it)."""
        if slot in self._held_slots:
            self._settle_idle()  # the held steps were the slot's last request's
        self.acceptance.reset(slot)

    def held(self, slots: tuple[int, ...]) -> bool:
        """Whether this step of these rows (slot ids, in batch order) is plain without asking `plan`: a plan
        found that speculation did not pay, and plain steps bring no new acceptance evidence, so the answer
        holds for PLAIN_HOLD steps (CLOSE_HOLD after a close call, up to MAX_PLAIN_HOLD after clear losses in a
        row) while the batch has about as many rows (HOLD_SHRINK) or more (requests finishing and new ones
        taking their slots do not reopen it; a smaller batch, where verifying is cheaper, does). A held step is booked here; the
        engine decodes it plainly with no speculative bookkeeping, so that a batch too large to speculate
        pays almost nothing for the question."""
        if not self._hold or len(slots) < self._held_rows - self._held_rows // HOLD_SHRINK:
            return False
        if slots != self._held_slots:
            self._settle_idle()
            self._held_slots = slots
        self._hold -= 1
        self._idle_steps += 1
        self._plain_run += 1
        self.plain_steps += 1
        self.row_widths[0] += len(slots)
        return True

    def plan(self, slots, limits, catch_up: tuple[int, int] = (0, 0)) -> StepPlan:
        """`slots[b]`, `limits[b]` (int sequences: lists, arrays, CPU tensors): row b's slot and the most it
        may draft (room left, max_tokens, or drafts it has); `catch_up`: the proposer's extra catch-up this
        step (`Proposer.catch_up`), so that resuming is priced in."""
        slots, limits = np.asarray(slots), np.asarray(limits)
        if not self.adaptive:
            return StepPlan(min(self.fixed_width(len(slots)), int(limits.max())))
        self._settle_idle()
        rows = len(slots)
        if self.cost.drafts_before_plan:
            share = float((limits > 0).mean())
            self._draft_share = DRAFT_SHARE_DECAY * self._draft_share + (1 - DRAFT_SHARE_DECAY) * share
        drafts = np.minimum(np.arange(self.k + 1)[None, :], np.minimum(limits, self.k)[:, None])  # [B, k + 1]
        query_lens = (1 + drafts.mean(0)).tolist()  # a packed verify costs the real tokens
        seconds = self.cost.step_seconds_by_width(rows, query_lens, catch_up)
        rates = self.acceptance.rates(slots)
        gain, best, speculative, plain = self._choose(rates, drafts, seconds)
        probe, thin = speculative, self.acceptance.evidence() < THIN_EVIDENCE
        if not best.width and thin and (self._probing or self._probe_due()):
            # too little evidence to trust a pessimistic estimate (see THIN_EVIDENCE): a probe is judged at
            # the first guesses
            probe = self._choose(np.maximum(rates, self.acceptance.initial_rates), drafts, seconds)[2]
        best = self._explore(best, probe, plain, catch_up, thin)
        if best.width > 0 and self.cost.sequential_drafts and self.confidence_floor:
            # one more draft step costs a draft forward plus a wider verify; it pays while the row's chance
            # of acceptance exceeds that cost times the row's token rate. Draft confidences are not calibrated
            # acceptance rates (a one-layer head tends to be under-confident), hence the margin.
            step = max(self.cost.draft(rows, best.width + 1) - self.cost.draft(rows, best.width), 0.0) + max(
                self.cost.forward(rows, best.width + 2) - self.cost.forward(rows, best.width + 1), 0.0)
            best.stop_below = FLOOR_MARGIN * step * best.expected_tokens / best.expected_seconds / rows
        if best.width == 0:
            ratio = speculative.tokens_per_s / plain.tokens_per_s if speculative is not None else 0.0
            if self.cost.drafts_before_plan:
                # a step whose rows found few drafts says little about the next one's: hold by what a typical
                # step would do. Held for 8 steps after each such step, house n-gram at 8 in flight ran 81
                # of its 225 steps plain.
                ratio = self._typical_ratio(gain, plain)
                if ratio >= 1.0:
                    self._hold = self._clear_losses = 0
                    return best
            self._clear_losses = self._clear_losses + 1 if ratio < CLOSE_CALL else 0
            if ratio >= CLOSE_CALL:
                hold = CLOSE_HOLD if rows <= CLOSE_CALL_ROWS else PLAIN_HOLD
            else:
                hold = min(PLAIN_HOLD << (self._clear_losses - 1), MAX_PLAIN_HOLD)
                if ratio >= PROBE_WORST or thin:  # worth a probe: re-planned when one is due
                    hold = min(hold, max(self._probe_after - self._plain_run, PLAIN_HOLD))
            self._hold = hold - 1
            self._held_rows, self._held_slots = rows, tuple(slots.tolist())
        else:
            self._hold = self._clear_losses = 0
        return best

    def _choose(self, rates: np.ndarray, drafts: np.ndarray, seconds: list[float]):
        """-> (gain, best plan, best speculative plan or None, plain plan) for rows with these acceptance rates;
        gain[b, w]: row b's expected extra tokens from drafting w."""
        rows = rates.shape[0]
        gain = np.zeros((rows, self.k + 1))  # 0, a1, a1 + a1 a2, ...
        np.cumsum(rates.cumprod(1), 1, out=gain[:, 1:])
        tokens = (rows + np.take_along_axis(gain, drafts, 1).sum(0)).tolist()
        plain = StepPlan(0, 0.0, tokens[0], max(seconds[0], 1e-9))
        best, speculative = plain, None
        for width in range(1, len(tokens)):
            if tokens[width] <= tokens[width - 1]:
                break  # no row can use a wider step
            candidate = StepPlan(width, 0.0, tokens[width], max(seconds[width], 1e-9))
            if candidate.tokens_per_s > best.tokens_per_s:
                best = candidate
            if speculative is None or candidate.tokens_per_s > speculative.tokens_per_s:
                speculative = candidate
        return gain, best, speculative, plain

    def _probe_due(self) -> bool:
        return not self._probing and self._plain_run >= self._probe_after

    def _typical_ratio(self, gain: np.ndarray, plain: StepPlan) -> float:
        """For proposers that draft before the plan: the best speculative width's tokens/s over plain decoding's
        on a step where rows have drafts as often as they have lately (`_draft_share`), each up to k, with the
        drafting that a held step skips priced in."""
        rows, share = gain.shape[0], self._draft_share
        widths = np.arange(1, self.k + 1)
        tokens = rows + share * gain[:, 1:].sum(0)
        seconds = np.asarray(self.cost.step_seconds_by_width(rows, [1.0, *(1 + share * widths).tolist()])[1:])
        drafting = np.array([self.cost.drafting(rows, int(w)) for w in widths])
        return float((tokens / (seconds + drafting)).max()) / plain.tokens_per_s

    def _explore(self, best: StepPlan, speculative: StepPlan | None, plain: StepPlan,
                 catch_up: tuple[int, int], thin: bool = False) -> StepPlan:
        """`best`, or a probe of `speculative` when plain steps have gone on long enough (see PROBE_AFTER; with
        `thin` evidence, the wait does not grow)."""
        if best.width:
            self._plain_run, self._probing = 0, 0
            self._probe_after = PROBE_AFTER
            return best
        probe_worth = False
        if speculative is not None and not self.cost.drafts_before_plan:
            # a probe may be all the speculation there is for a while: its catch-up counts whole, not spread
            whole = speculative.expected_seconds + self.cost.catch_up(*catch_up) * (1 - 1 / CATCH_UP_HORIZON)
            probe_worth = speculative.expected_tokens / whole >= PROBE_WORST * plain.tokens_per_s
        if probe_worth and self._probe_due():
            self._probing, self._plain_run = PROBE_STEPS, 0
            if not thin:
                self._probe_after = min(2 * self._probe_after, MAX_PROBE_AFTER)
        if probe_worth and self._probing:
            self._probing -= 1
            return speculative
        self._probing = 0
        self._plain_run += 1
        return best

    def idle(self, slots) -> None:
        """A plain step that was planned (not held): old acceptance and cost evidence fade, in one go with the
        steps after it at the next plan, as for held steps (a few small tensor ops a step otherwise)."""
        key = tuple(np.asarray(slots).tolist())
        if key != self._held_slots:
            self._settle_idle()
            self._held_slots = key
        self._idle_steps += 1

    def _settle_idle(self) -> None:
        """The held steps' idle decay, applied in one go."""
        if self._idle_steps:
            self.acceptance.idle(list(self._held_slots), self._idle_steps)
            if self.cost is not None:
                self.cost.idle(self._idle_steps)
            self._idle_steps = 0

    def record(self, limits, width: int) -> None:
        if width == 0:
            self.plain_steps += 1
            self.row_widths[0] += len(limits)
            return
        for given in np.minimum(np.asarray(limits), width).tolist():
            self.row_widths[given] += 1

    def reset_metrics(self) -> None:
        self.row_widths = [0] * (self.k + 1)
        self.plain_steps = 0

    def metrics(self) -> dict:
        return {"spec_k_histogram": list(self.row_widths), "num_steps_without_speculation": self.plain_steps}
